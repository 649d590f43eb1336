"""What compose() returns: the accelerated training objects and the plan that made them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class PlanStep:
    """One acceleration compose() applied: what, through which engine, with which details."""

    name: str
    engine: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.engine}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class TrainState:
    """The model, optimizer, data and numerics of a run after compose().

    ``model`` is what forward is called on (it may be wrapped, e.g. by DDP);
    ``unwrapped_model`` is the user's module, whose state_dict keys never change.
    """

    model: nn.Module
    unwrapped_model: nn.Module
    device: torch.device
    optimizer: Optimizer | None = None
    lr_scheduler: LRScheduler | None = None
    train_dataloader: DataLoader | None = None
    eval_dataloader: DataLoader | None = None
    grad_scaler: torch.amp.GradScaler | None = None
    autocast_dtype: torch.dtype | None = None
    plan: list[PlanStep] = field(default_factory=list)
    deepspeed: Any = None
    """The DeepSpeed engine under --zero-backend deepspeed (then also ``model``): it runs
    backward and the optimizer step."""
