"""ZeRO through the DeepSpeed engine (``--zero-backend deepspeed``).

The same memory flags as the native backend choose the stage: OSS / ZeRO-1 -> stage 1, SDP /
ZeRO-2 -> stage 2, FSDP / ZeRO-3 -> stage 3. The DeepSpeed config is generated from our flags
(micro and global batch, accumulation steps, clipping, precision, offload), so a user never
writes one. DeepSpeed then owns the model (its engine is ``state.model``), the backward (it
partitions and reduces gradients in its hooks) and the optimizer step (master weights, clipping
and the update of its own partitions).

What stays ours:

* the optimizer: the torch optimizer rapidformer built (or the user handed compose()) is given
  to DeepSpeed, which steps it on its partitions. This also keeps DeepSpeed's JIT-compiled ops
  (fused/CPU Adam) out of the path (on a CPU, DeepSpeed still builds its shared-memory
  communication op once per machine).
* the LR schedule: our scheduler sets the learning rate on that optimizer's groups, which
  DeepSpeed's partitions share.
* exact, count-weighted accumulation: each micro-batch's loss is scaled by its count over a
  rank-common reference; at the step's last micro-batch, when the global count is known, a
  step whose micro-batches were not all equal has its (already reduced) gradient partitions
  rescaled in place on each rank (:func:`rescale_gradients`), before DeepSpeed clips and steps.

Checkpoints go through DeepSpeed's save/load (each rank writes its partitions);
:func:`consolidated_state_dict` rebuilds the whole fp32 model from them in one process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from rapidformer.accel.sharding import sharding_mode
from rapidformer.config.schema import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.engine.state import PlanStep, TrainState
from rapidformer.memory import StateBytes, held_bytes, state_slots

TAG = "deepspeed"
"""Sub-directory of a rapidformer checkpoint that holds DeepSpeed's files."""

_STAGES = {"oss": 1, "sdp": 2, "fsdp": 3}
# DeepSpeed's default buckets are 500M elements: on a small model that reserves gigabytes of
# staging buffers the ZeRO formulas do not count. 50M keeps overlap without the waste.
_BUCKET = 50_000_000


def is_deepspeed(config: RapidformerConfig) -> bool:
    return config.memory.zero_backend == "deepspeed"


def _mode(config: RapidformerConfig) -> tuple[str, str]:
    mode = sharding_mode(config)
    assert mode is not None, "validation requires a ZeRO flag with --zero-backend deepspeed"
    return mode


def deepspeed_config(
    config: RapidformerConfig, dims: ParallelDims, accumulation_steps: int
) -> dict[str, Any]:
    """The DeepSpeed config our flags mean."""
    stage = _STAGES[_mode(config)[0]]
    micro = config.data.micro_batch_size
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": _BUCKET,
        "allgather_bucket_size": _BUCKET,
    }
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=_BUCKET, stage3_param_persistence_threshold=0)
    if config.memory.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    precision = config.precision.resolved
    clip = config.training.clip_grad
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro * accumulation_steps * dims.dp,
        "gradient_clipping": clip if clip > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Our torch optimizer, not DeepSpeed's compiled ones (also under offload).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # rapidformer logs the steps
        "wall_clock_breakdown": False,
    }


def apply_deepspeed(state: TrainState, config: RapidformerConfig, dims: ParallelDims) -> TrainState:
    """Hand the model and the optimizer just built to ``deepspeed.initialize``."""
    import deepspeed

    assert state.optimizer is not None, "the optimizer is built before DeepSpeed takes it"
    # DeepSpeed reads the launcher's LOCAL_RANK; a one-process run started without torchrun
    # has none (the group of one was made by the engine).
    os.environ.setdefault("LOCAL_RANK", "0")
    # DeepSpeed logs every config key at INFO on every rank; our plan says what matters.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_config = deepspeed_config(config, dims, dims.accumulation_steps(config))
    engine, _, _, _ = deepspeed.initialize(
        model=state.model,
        optimizer=state.optimizer,
        config=ds_config,
        dist_init_required=False,
    )
    stage = ds_config["zero_optimization"]["stage"]
    sharded = {1: "optimizer state", 2: "optimizer state, gradients"}.get(
        stage, "optimizer state, gradients, parameters"
    )
    detail = f"{sharded} sharded over {dims.dp} ranks; {type(engine.optimizer).__name__}"
    detail += f" stepping {type(state.optimizer).__name__}"
    if config.precision.resolved != "fp32":
        detail += f"; {config.precision.resolved} with fp32 master weights"
    if config.memory.cpu_offload:
        detail += "; ZeRO-Offload: optimizer state" + (" and parameters" if stage == 3 else "")
        detail += " on the CPU"
    state.plan.append(
        PlanStep(
            f"{_mode(config)[1]} (DeepSpeed)",
            f"deepspeed {deepspeed.__version__} ZeRO stage {stage}",
            detail,
        )
    )
    state.model = engine
    state.deepspeed = engine
    return state


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The whole model state dict with the fp32 master weights (not the bf16/fp16 copies the
    module computes with), gathered from every rank's partitions: a collective, every rank
    calls it and gets the whole dict."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    full = {name: safe_get_full_fp32_param(p).cpu() for name, p in module.named_parameters()}
    # Buffers (and anything else the state dict holds) are whole on every rank.
    names = set(full)
    for name, tensor in module.state_dict().items():
        if name not in names and tensor.numel():
            full[name] = tensor.cpu()
    return full


def rescale_gradients(engine: Any, factor: float) -> None:
    """Multiply the gradients DeepSpeed holds for the coming step (reduced and partitioned).
    Each rank scales its own partitions: no communication."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        for param in engine.module.parameters():
            grad = safe_get_local_grad(param) if param.requires_grad else None
            if grad is not None:
                safe_set_local_grad(param, grad * factor)
        return
    if getattr(optimizer, "cpu_offload", False):
        # ZeRO-Offload at stage 1/2 accumulates the step's gradient straight into the fp32
        # CPU partitions and keeps each parameter's gradient norm for clipping, out of reach
        # of the gradient API: scale both (tests/accel/test_deepspeed.py guards this).
        for partition in optimizer.single_partition_of_fp32_groups:
            if partition.grad is not None:
                partition.grad.mul_(factor)
        norms = optimizer.norm_for_param_grads
        for key in norms:
            norms[key] = norms[key] * abs(factor)
        return
    # Stage 1/2 hold the step's reduced gradient partitions in ``averaged_gradients``, which
    # step() flattens (DeepSpeed's safe_set_full_grad would all-reduce every whole gradient).
    assert hasattr(optimizer, "averaged_gradients"), f"cannot rescale {type(optimizer).__name__}"
    parts = optimizer.averaged_gradients.values()
    torch._foreach_mul_([g for part in parts for g in part or () if g is not None], factor)


def held_state_bytes(engine: Any) -> StateBytes:
    """Model-state bytes this rank holds under DeepSpeed, counted from its tensors: the
    module's parameters (their partitions at stage 3) plus the fp32 master partitions (when
    they are a separate copy), the gradient partitions, and the optimizer's state."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    # The fp32 master partitions the optimizer steps (stage 3 swaps them into the optimizer's
    # groups only while it steps, so they are read from DeepSpeed's own lists).
    masters = list(
        getattr(optimizer, "single_partition_of_fp32_groups", None)
        or getattr(optimizer, "fp32_partitioned_groups_flat", None)
        or [p for group in inner.param_groups for p in group["params"]]
    )
    module_params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    module_storage = {_storage(p) for p in module_params}
    parameters = sum(held_bytes(p) for p in module_params)
    parameters += sum(held_bytes(m) for m in masters if _storage(m) not in module_storage)
    # Between the last backward of a step and the step, the reduced gradient partitions sit in
    # ``averaged_gradients`` (or, under offload, on the fp32 masters); whole ones only on the
    # module's parameters.
    grads = [m.grad for m in masters if m.grad is not None]
    grads += [p.grad for p in engine.module.parameters() if p.grad is not None]
    for partition in getattr(optimizer, "averaged_gradients", {}).values():
        grads += [g for g in partition or () if g is not None]
    unique = {(_storage(g), g.storage_offset(), g.numel()): g for g in grads}
    gradients = sum(held_bytes(g) for g in unique.values())
    optimizer_bytes = sum(
        held_bytes(t)
        for slots in inner.state.values()
        for t in slots.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    )
    return StateBytes(parameters=parameters, gradients=gradients, optimizer=optimizer_bytes)


def expected_state_bytes(engine: Any) -> tuple[StateBytes, StateBytes]:
    """(this rank once training, plain DDP), before the first step: gradient partitions the
    size of the fp32 masters, optimizer state a slot per master element."""
    now = held_state_bytes(engine)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    masters = sum(
        held_bytes(m)
        for m in getattr(engine.optimizer, "single_partition_of_fp32_groups", None)
        or getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
        or ()
    )
    slots = state_slots(inner)
    held = StateBytes(now.parameters, masters, slots * masters)
    full = sum(
        getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters()
    )
    return held, StateBytes(full, full, slots * full)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.numel() else -1


def save(engine: Any, directory: Path) -> None:
    """Every rank writes its partitions under ``directory``/deepspeed (a collective)."""
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)


def load(engine: Any, directory: Path) -> None:
    """Restore the model, optimizer partitions and DeepSpeed's counters (a collective)."""
    path, _ = engine.load_checkpoint(
        str(directory), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory / TAG}")


def is_deepspeed_checkpoint(directory: Path) -> bool:
    return (directory / TAG).is_dir()


def consolidated_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 model state dict from a DeepSpeed checkpoint, in this one process (no
    process group: DeepSpeed's zero_to_fp32 merges the ranks' partition files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    return {name: tensor.contiguous() for name, tensor in state.items()}
