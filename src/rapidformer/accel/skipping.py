"""Skipping a non-finite step without the host: the optimizer and the schedule take the
decision as a device tensor.

torch's fused optimizers (``AdamW(fused=True)``, the default here) read two optional
attributes in ``step()``: ``grad_scale`` and ``found_inf``. Where ``found_inf`` is 1.0 their
kernel leaves every parameter and moment untouched and takes back its step-counter increment,
on the device, with no read to the host: exactly what GradScaler relies on. The stepper hands
them the step guard's agreed skip flag as ``found_inf`` (gradients already unscaled, so no
``grad_scale``), for a non-finite loss or gradient as much as for an fp16 overflow. rapidformer's
own LAMB takes the same input. The ZeRO-1/OSS wrappers step an inner optimizer (``.optim``),
which receives the flag.

The learning-rate schedule then counts applied steps on the device
(:class:`rapidformer.schedules.WarmupDecaySchedule`), so a skipped step does not advance it.

Where either part cannot take a device decision (an optimizer without ``found_inf``, e.g.
apex's, a ``foreach`` AdamW or a user's; a user's host-side LR scheduler; DeepSpeed), the step
reads the decision to the host once, as before, and the plan says so and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rapidformer.accel.partitioned_optimizer import PartitionedOptimizer
from rapidformer.schedules import WarmupDecaySchedule
from rapidformer.state import PlanStep

WRAPPERS = (ZeroRedundancyOptimizer, PartitionedOptimizer)
"""Optimizers that step an inner optimizer held in ``.optim`` over this rank's partition."""


def found_inf_taker(optimizer: Optimizer) -> Optimizer | None:
    """The optimizer whose ``step()`` applies ``optimizer``'s update and honours a
    ``found_inf`` attribute, or None where none does."""
    target = optimizer.optim if isinstance(optimizer, WRAPPERS) else optimizer
    return target if getattr(target, "_step_supports_amp_scaling", False) else None


def on_device_obstacle(optimizer: Optimizer, schedule: LRScheduler | None) -> str:
    """Why this optimizer and schedule cannot skip a step on the device; "" when they can."""
    if found_inf_taker(optimizer) is None:
        inner = optimizer.optim if isinstance(optimizer, WRAPPERS) else optimizer
        return f"{type(inner).__name__} takes no found_inf input"
    if schedule is not None and not isinstance(schedule, WarmupDecaySchedule):
        return f"the LR scheduler {type(schedule).__name__} steps on the host"
    return ""


def plan_decision(
    optimizer: Optimizer, schedule: LRScheduler | None, device: torch.device
) -> tuple[bool, PlanStep]:
    """Whether steps are skipped on the device (then the schedule starts counting there) and
    the plan line that says so."""
    obstacle = on_device_obstacle(optimizer, schedule)
    if obstacle:
        return False, PlanStep(
            "step decision",
            "on the host, one read per step",
            f"{obstacle}: the skip of a non-finite step waits for the device",
        )
    if isinstance(schedule, WarmupDecaySchedule):
        schedule.count_on_device(device)
    return True, PlanStep(
        "step decision",
        "on the device, no host sync",
        "non-finite steps are skipped through the optimizer's found_inf; the host learns of "
        "them every --log-interval steps",
    )


@contextlib.contextmanager
def skipping_when(optimizer: Optimizer, skip: torch.Tensor) -> Iterator[None]:
    """Inside, ``optimizer.step()`` changes nothing where ``skip`` is 1.0 (a device tensor)."""
    taker = found_inf_taker(optimizer)
    assert taker is not None, "plan_decision() chose the host for this optimizer"
    taker.found_inf = skip  # type: ignore[attr-defined]
    taker.grad_scale = None  # type: ignore[attr-defined]  # unscaled already
    try:
        yield
    finally:
        del taker.found_inf  # type: ignore[attr-defined]
        del taker.grad_scale  # type: ignore[attr-defined]
