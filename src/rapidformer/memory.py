"""Bytes of model state (parameters, gradients, optimizer state) one rank holds.

Counted from the tensors themselves: a sharded (DTensor) parameter counts its local shard, a
ZeroRedundancyOptimizer counts the state of its own partition only. :func:`expected_bytes`
predicts, before the first step, what the rank will hold once gradients and optimizer state
exist, next to what plain DDP would hold. :func:`peak_memory_bytes` is what the process used at
its peak, as the log reports it.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer

from rapidformer.distributed.tensors import local_part
from rapidformer.loaded import instance_of


@dataclass(frozen=True)
class StateBytes:
    """Bytes of each kind of model state on one rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (its local shard for a DTensor)."""
    local = local_part(tensor)
    flatten = getattr(local, "__tensor_flatten__", None)
    if callable(flatten):
        # A tensor subclass that stores other tensors (torchao's NF4: codes and scales).
        inner, _ = flatten()
        return sum(held_bytes(getattr(local, name)) for name in inner)
    return local.numel() * local.element_size()


def _local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer over this rank's partition (ZeRO-1), else ``optimizer``."""
    inner = getattr(optimizer, "optim", None)
    if instance_of(optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer") or isinstance(
        inner, Optimizer
    ):
        return inner  # type: ignore[return-value]
    return optimizer


def _optimizer_params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in _local_optimizer(optimizer).param_groups for p in g["params"]]


def state_slots(optimizer: Optimizer) -> int:
    """Per-parameter state tensors the optimizer keeps (Adam-like: 2; momentum SGD: 1)."""
    defaults = _local_optimizer(optimizer).defaults
    if "betas" in defaults:
        return 2
    return 1 if defaults.get("momentum", 0) else 0


def measured_bytes(model: nn.Module, optimizer: Optimizer | None) -> StateBytes:
    """What this rank holds right now."""
    params = list(model.parameters())
    optimizer_bytes = 0
    if optimizer is not None:
        for slots in _local_optimizer(optimizer).state.values():
            tensors: Iterable[object] = slots.values()
            optimizer_bytes += sum(
                held_bytes(t) for t in tensors if isinstance(t, torch.Tensor) and t.ndim > 0
            )
    return StateBytes(
        parameters=sum(held_bytes(p) for p in params),
        gradients=sum(held_bytes(p.grad) for p in params if p.grad is not None),
        optimizer=optimizer_bytes,
    )


def expected_bytes(
    model: nn.Module, optimizer: Optimizer | None, whole: nn.Module | None = None
) -> tuple[StateBytes, StateBytes]:
    """(this rank once training, plain DDP) for a model whose gradients and optimizer state do
    not exist yet: gradients mirror the trainable parameters this rank holds, optimizer state
    the parameters its optimizer steps. Plain DDP holds the whole model: ``whole`` (the unsplit
    model, e.g. on the meta device) where this rank holds pipeline stages only."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = StateBytes(
        parameters=sum(held_bytes(p) for p in model.parameters()),
        gradients=sum(held_bytes(p) for p in params),
        optimizer=0
        if optimizer is None
        else state_slots(optimizer) * sum(held_bytes(p) for p in _optimizer_params(optimizer)),
    )
    reference = whole if whole is not None else model
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    trainable = sum(p.numel() * p.element_size() for p in reference.parameters() if p.requires_grad)
    slots = 0 if optimizer is None else state_slots(optimizer)
    ddp = StateBytes(parameters=full, gradients=trainable, optimizer=slots * trainable)
    return held, ddp


def describe(held: StateBytes, ddp: StateBytes) -> str:
    """One line: each kind in MiB, as a fraction of plain DDP."""

    def part(name: str, mine: int, theirs: int) -> str:
        ratio = f"{mine / theirs:.2f}x" if theirs else "-"
        return f"{name} {mine / 2**20:.2f} MiB ({ratio})"

    return (
        ", ".join(
            [
                part("parameters", held.parameters, ddp.parameters),
                part("gradients", held.gradients, ddp.gradients),
                part("optimizer state", held.optimizer, ddp.optimizer),
                part("total", held.total, ddp.total),
            ]
        )
        + " of what plain DDP holds per rank (the whole, unsplit model)"
    )


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # The memory's high-water mark: ru_maxrss would keep, for a process started by fork and
    # exec, the resident set its parent had when it forked.
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
