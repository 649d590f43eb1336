"""What DeepSpeed holds: model-state bytes per rank, and its checkpoint format.

:class:`DeepSpeedFormat` is the checkpoint-format slot (:class:`rapidformer.state.
CheckpointFormat`) of a DeepSpeed run: each rank writes its partitions through DeepSpeed's own
save into ``iter_N/deepspeed/``; such a checkpoint resumes under DeepSpeed, at the same stage,
on as many ranks as wrote it. :func:`read_model_state` merges the partition files into the whole
fp32 model in one process (DeepSpeed's ``zero_to_fp32``), for export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import CheckpointError
from rapidformer.memory import StateBytes, held_bytes, state_slots
from rapidformer.safe_load import deepspeed_loading
from rapidformer.state import TrainState

TAG = "deepspeed"
"""Sub-directory of a rapidformer checkpoint that holds DeepSpeed's files."""


class DeepSpeedFormat:
    """DeepSpeed's save/load behind rapidformer's checkpoint interface."""

    name = "deepspeed"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def save(self, state: TrainState, directory: Path) -> None:
        # Every rank writes its own partitions (a collective).
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def record(self, state: TrainState) -> dict[str, Any]:
        return {"deepspeed_stage": self.engine.zero_optimization_stage()}

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        saved_stage = record.get("deepspeed_stage")
        stage = self.engine.zero_optimization_stage()
        if saved_stage is not None and saved_stage != stage:
            raise CheckpointError(
                f"{directory} holds DeepSpeed ZeRO stage {saved_stage} partitions and this run "
                f"uses stage {stage}: resume with the ZeRO flag of stage {saved_stage}"
            )
        saved_ranks, ranks = record.get("world_size", 1), process_group.world_size()
        if saved_ranks != ranks:
            raise CheckpointError(
                f"{directory} holds DeepSpeed partitions of {saved_ranks} ranks and this run has "
                f"{ranks}: resume on {saved_ranks} ranks, or use the native backend (its "
                "checkpoints reshard to any rank count)"
            )
        with deepspeed_loading(deepspeed_files(directory)):  # through the allowlist
            path, _ = self.engine.load_checkpoint(
                str(directory), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if path is None:
            raise CheckpointError(f"no DeepSpeed checkpoint in {directory / TAG}")

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:
        full = full_state_dict(self.engine)
        return full if process_group.rank() == 0 else None


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


def read_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 model state dict from a DeepSpeed checkpoint, in this one process (no
    process group: DeepSpeed's zero_to_fp32 merges the ranks' partition files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with deepspeed_loading(deepspeed_files(directory)):  # through the allowlist
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    return {name: tensor.contiguous() for name, tensor in state.items()}


def deepspeed_files(directory: Path) -> list[Path]:
    """The files DeepSpeed's loaders unpickle in a checkpoint directory."""
    return sorted(f for f in (directory / TAG).rglob("*") if f.is_file() and f.suffix == ".pt")


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
