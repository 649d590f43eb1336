"""Learning-rate schedules: linear warmup from 0, then constant, linear or cosine decay to
--min-lr at the last step (Megatron's shape).

A skipped step (a non-finite loss or gradient) does not advance the schedule. Where the step is
decided on the device (:mod:`rapidformer.step.optimizer_step`), so is the schedule:
:class:`WarmupDecaySchedule` then counts the applied steps in a device tensor and writes each
group's learning rate as a 0-dim device tensor that torch's fused optimizers read, and the host
never has to know whether a step was applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from rapidformer.config.root import RapidformerConfig


def warmup_steps(config: RapidformerConfig, total_steps: int) -> int:
    fraction = config.training.lr_warmup_fraction
    if fraction is not None:
        return round(fraction * total_steps)
    return config.training.lr_warmup_iters


@dataclass(frozen=True)
class Shape:
    """Multiplier of the peak learning rate at each applied step (0-based)."""

    total: int
    warmup: int
    style: str
    min_ratio: float

    def factor(self, step: int) -> float:
        """The multiplier for the step about to be taken, on the host."""
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.style == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - progress
        if self.style == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape

    def factor_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """The same multiplier from a float64 device step count, without leaving the device."""
        if self.style == "constant":
            value = torch.ones_like(step)
        else:
            progress = ((step - self.warmup) / max(1, self.total - self.warmup)).clamp(max=1.0)
            shape = 1.0 - progress
            if self.style == "cosine":
                shape = 0.5 * (1.0 + torch.cos(math.pi * progress))
            value = self.min_ratio + (1.0 - self.min_ratio) * shape
        if self.warmup > 0:
            value = torch.where(step < self.warmup, (step + 1) / self.warmup, value)
        return value


class WarmupDecaySchedule(LambdaLR):
    """The flags' schedule: a ``LambdaLR`` on the host, or counted on the device once
    :meth:`count_on_device` was called (then :meth:`step` takes whether the step applied)."""

    def __init__(self, optimizer: Optimizer, shape: Shape) -> None:
        self.shape = shape
        self.applied: torch.Tensor | None = None
        """Applied steps so far (float64, on the device) while counted on the device."""
        super().__init__(optimizer, lambda step: shape.factor(step))

    def count_on_device(self, device: torch.device) -> None:
        """From now on count applied steps in a device tensor and keep the learning rates as
        device tensors (for optimizers that read a tensor ``lr``)."""
        self.applied = torch.tensor(float(self.last_epoch), dtype=torch.float64, device=device)
        self._write_device_lr()

    def step(self, epoch: Any = None, *, applied: torch.Tensor | None = None) -> None:
        """Advance by one step on the host, or by ``applied`` (1.0 or 0.0, on the device)
        steps when counted on the device."""
        if self.applied is None:
            super().step(epoch)
            return
        assert applied is not None, "counted on the device: pass applied=decision.applied"
        self.applied = self.applied + applied.to(self.applied)
        self._write_device_lr()

    def _write_device_lr(self) -> None:
        assert self.applied is not None
        factor = self.shape.factor_tensor(self.applied)
        # New tensors, not in place: the step that just used the old ones still reports them.
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = (base * factor).float()

    def state_dict(self) -> dict[str, Any]:
        if self.applied is not None:  # a checkpoint reads the count (never inside a step)
            self.last_epoch = int(self.applied.item())
            self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        state = super().state_dict()
        state.pop("applied", None)
        state.pop("shape", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.applied is not None:
            self.count_on_device(self.applied.device)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        if self.applied is None:
            return super().get_last_lr()
        return [float(g["lr"]) for g in self.optimizer.param_groups]


def build_lr_scheduler(
    optimizer: Optimizer, config: RapidformerConfig, total_steps: int
) -> WarmupDecaySchedule:
    """The schedule the flags describe, over ``total_steps`` optimizer steps."""
    lr = config.training.lr or 0.0
    min_ratio = config.training.min_lr / lr if lr > 0 else 0.0
    warmup = warmup_steps(config, total_steps)
    shape = Shape(total_steps, warmup, config.training.lr_decay_style, min_ratio)
    return WarmupDecaySchedule(optimizer, shape)
