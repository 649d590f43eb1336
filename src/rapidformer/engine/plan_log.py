"""The run plan compose() logs: the accelerations in order, the model state each rank holds,
and the hardware's peak with the model's FLOPs per token (what MFU is measured against)."""

from __future__ import annotations

from typing import Any

import torch

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.flops import MfuMeter, mfu_meter
from rapidformer.hardware import Peak, device_peak, precision_support
from rapidformer.log import log
from rapidformer.memory import describe
from rapidformer.state import PlanStep, TrainState
from rapidformer.threads import ThreadChoice


def measure_peak(device: torch.device, config: RapidformerConfig) -> Peak:
    """This device's peak for the run's precision (a CPU is probed: set-up, rank 0 only)."""
    # fp8 keeps the bf16 peak as MFU's denominator (the float8 matmuls are a speed-up, not a
    # different model).
    return device_peak(device, config.precision.autocast, config.logging.peak_tflops)


def model_mfu_meter(
    state: TrainState, config: RapidformerConfig, peak: Peak, world_size: int
) -> MfuMeter:
    """FLOPs per token of the composed model against ``peak``."""
    model = state.unwrapped_model
    shape_config = getattr(model, "config", None)
    seq = config.model.seq_length or _first_int(
        shape_config, "max_position_embeddings", "n_positions"
    )
    memory = config.memory
    # The hardware runs every layer's forward twice under full recomputation of all layers;
    # selective (pointwise ops only) and block (some layers) are not counted.
    checkpointing = memory.recompute_granularity == "full" and memory.recompute_method != "block"
    return mfu_meter(model, seq, checkpointing, peak.tflops, world_size)


def trust_steps(config: RapidformerConfig) -> list[PlanStep]:
    """The run's consent to running code from files it loads, named in the plan."""
    steps = []
    if config.checkpoint.trust_checkpoint:
        steps.append(
            PlanStep(
                "checkpoint loading",
                "pickle, not scanned (--trust-checkpoint)",
                "checkpoint files are unpickled as they are; without the flag every pickle is "
                "scanned against an allowlist first",
            )
        )
    if config.model.trust_remote_code:
        steps.append(
            PlanStep(
                "Hugging Face remote code",
                "trust_remote_code=True (--trust-remote-code)",
                f"the Python files of {config.model.pretrained_model_name_or_path} run when "
                "the model and tokenizer load",
            )
        )
    return steps


def log_plan(
    state: TrainState,
    config: RapidformerConfig,
    device: torch.device,
    mesh: ParallelMesh,
    peak: Peak,
    meter: MfuMeter,
    threads: ThreadChoice,
) -> None:
    """Log the plan (call it on rank 0: only rank 0 speaks)."""
    lines = [f"  {i}. {step}" for i, step in enumerate(state.plan, 1)] or ["  (none)"]
    log.info(
        "rapidformer plan on %s, %s; forward-backward: %s, step: %s\n%s",
        device,
        mesh.describe(),
        state.forward_backward.name,
        state.stepper.name,
        "\n".join(lines),
    )
    held, ddp = state.stepper.expected_bytes(state)
    log.info("model state on rank 0: %s", describe(held, ddp))
    precision = config.precision.precision
    support, hint = precision_support(device, precision)
    peak_text = f"{peak.tflops:.3g} TFLOP/s per device" if peak.tflops else "unknown"
    per_token = meter.per_token
    recompute = f", {per_token.hardware:.3g} with the recomputed forward" if meter.recompute else ""
    log.info(
        "hardware: %s; %s; %s peak %s (%s); model FLOPs per token %.3g%s (%s)",
        support,
        threads,
        precision,
        peak_text,
        peak.source,
        per_token.model,
        recompute,
        meter.basis,
    )
    if hint:
        log.warning("precision: %s", hint)


def _first_int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0
