"""The torch optimizer step: gradients made ready, the ranks' decision, the update.

The default implementation of the stepper slot (:class:`rapidformer.state.Stepper`), for every
native layout. The engine calls it in two halves with the step guard's decision between them
(:mod:`rapidformer.reliability.guard`: every rank agrees to skip a step with a non-finite loss
or gradient anywhere, or an fp16 overflow):

1. :meth:`TorchStepper.finish_gradients` (:mod:`rapidformer.step.gradients`): the averaging no
   wrapper did, fp16's unscale (each rank checked only the gradients it holds, so the found-inf
   flags are summed over every rank of the job: all of them skip the step, or none does), then
   the global gradient norm over every shard of every parameter and clipping.
2. :meth:`TorchStepper.update`: the optimizer step, then the loss-scale update (which halves
   the scale after an overflow, on the device), then the gradients are zeroed.

**Skipping without the host.** torch's fused optimizers (``AdamW(fused=True)``, the default
here) read two optional attributes in ``step()``: ``grad_scale`` and ``found_inf``. Where
``found_inf`` is 1.0 their kernel leaves every parameter and moment untouched and takes back
its step-counter increment, on the device, with no read to the host: exactly what GradScaler
relies on. The stepper hands them the guard's agreed skip flag as ``found_inf`` (gradients
already unscaled, so no ``grad_scale``), for a non-finite loss or gradient as much as for an
fp16 overflow. rapidformer's own LAMB takes the same input; the ZeRO-1/OSS wrappers step an
inner optimizer (``.optim``), which receives the flag. The learning-rate schedule counts applied
steps on the device (:class:`rapidformer.schedules.WarmupDecaySchedule`), so a skipped step does
not advance it.

Where either part cannot take a device decision (an optimizer without ``found_inf``, e.g.
apex's, a ``foreach`` AdamW or a user's; a user's host-side LR scheduler), the engine reads the
decision to the host once per step and the stepper skips on the host, as the plan says and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rapidformer.distributed import process_group
from rapidformer.loaded import instance_of
from rapidformer.memory import StateBytes, expected_bytes
from rapidformer.schedules import WarmupDecaySchedule
from rapidformer.state import PlanStep, TrainState
from rapidformer.step.gradients import align_gradients, average_gradients, clip_gradients, unscale
from rapidformer.step.scaler_state import found_inf_flags
from rapidformer.step_io import FinishedGradients, StepResult

if TYPE_CHECKING:
    from rapidformer.reliability.guard import Decision


_UNSET = object()


class TorchStepper:
    """Steps ``state.optimizer``; see the module docstring."""

    name = "torch optimizer"

    def __init__(self, clip_grad: float) -> None:
        self.max_norm = clip_grad if clip_grad > 0 else float("inf")
        self.skips_on_device = False
        """Whether a skip is taken as a device tensor (set by :meth:`prepare`)."""
        self._norm_group: Any = _UNSET
        """Where the gradient norm's pieces are summed: the pipeline's stages (looked up once,
        by :meth:`prepare` or the first step)."""

    def prepare(self, state: TrainState) -> PlanStep | None:
        """Choose, once the optimizer and schedule exist, where a skip is decided."""
        assert state.optimizer is not None, "compose() built no optimizer"
        self._norm_group = state.mesh.group("pp")
        obstacle = on_device_obstacle(state.optimizer, state.lr_scheduler)
        self.skips_on_device = not obstacle
        if obstacle:
            return PlanStep(
                "step decision",
                "on the host, one read per step",
                f"{obstacle}: the skip of a non-finite step waits for the device",
            )
        if isinstance(state.lr_scheduler, WarmupDecaySchedule):
            state.lr_scheduler.count_on_device(state.device)
        return PlanStep(
            "step decision",
            "on the device, no host sync",
            "non-finite steps are skipped through the optimizer's found_inf; the host learns "
            "of them every --log-interval steps",
        )

    def finish_gradients(self, state: TrainState) -> FinishedGradients:
        optimizer = state.optimizer
        assert optimizer is not None, "compose() built no optimizer"
        parameters = state.parameters
        align_gradients(parameters)
        average_gradients(parameters, state.gradient_sync)
        overflow = None
        scaler = state.precision.grad_scaler
        if scaler is not None:
            unscale(scaler, optimizer)
            flags = found_inf_flags(scaler, optimizer)
            for flag in flags:  # summed over every rank: all of them skip, or none does
                process_group.all_reduce_sum(flag, state.mesh.group("world"))
            overflow = torch.stack([f.to(state.device) for f in flags]).sum()
        if self._norm_group is _UNSET:
            self._norm_group = state.mesh.group("pp")
        norm = clip_gradients(
            parameters,
            self.max_norm,
            self._norm_group,
            state.forward_backward.norm_skips(state),
        )
        # The tensor this step reads (the schedule writes new ones after it).
        lr = optimizer.param_groups[0]["lr"]
        return FinishedGradients(norm=norm.detach(), overflow=overflow, lr=lr)

    def update(
        self, state: TrainState, gradients: FinishedGradients, decision: Decision, totals: Tensor
    ) -> StepResult:
        optimizer, schedule = state.optimizer, state.lr_scheduler
        assert optimizer is not None, "compose() built no optimizer"
        skipped: torch.Tensor | bool
        if self.skips_on_device:
            with skipping_when(optimizer, decision.skip):
                optimizer.step()
            if schedule is not None:
                schedule.step(applied=decision.applied)  # type: ignore[call-arg]
            skipped = decision.skip
        else:
            assert decision.report is not None, "the engine reads a host decision first"
            skipped = bool(decision.report.reason)
            if not skipped:
                optimizer.step()
                if schedule is not None:
                    schedule.step()
        scaler = state.precision.grad_scaler
        if scaler is not None:
            scaler.update()  # halves the scale after an overflow, from the agreed found-inf
        optimizer.zero_grad(set_to_none=not state.gradient_sync.in_buckets)
        assert gradients.norm is not None, "finish_gradients() measured it"
        return StepResult.of(
            totals,
            grad_norm=gradients.norm,
            lr=gradients.lr,
            skipped=skipped,
            stop=decision.stop,
        )

    def expected_bytes(self, state: TrainState) -> tuple[StateBytes, StateBytes]:
        whole = getattr(state.model_parts[0], "whole_model_reference", None)
        reference = whole() if callable(whole) and len(state.model_parts) else None
        return expected_bytes(state.unwrapped_model, state.optimizer, reference)


class SteppingInner:
    """Marks an optimizer that steps an inner optimizer, held in ``.optim``, over this rank's
    partition (rapidformer's ZeRO-1 ``PartitionedOptimizer``; torch's ZeroRedundancyOptimizer
    is one too): the inner one receives the skip."""


def _applying(optimizer: Optimizer) -> Optimizer:
    """The optimizer whose ``step()`` applies ``optimizer``'s update."""
    wrapper = isinstance(optimizer, SteppingInner) or instance_of(
        optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer"
    )
    return optimizer.optim if wrapper else optimizer  # type: ignore[attr-defined]


def found_inf_taker(optimizer: Optimizer) -> Optimizer | None:
    """The optimizer whose ``step()`` applies ``optimizer``'s update and honours a
    ``found_inf`` attribute, or None where none does."""
    target = _applying(optimizer)
    return target if getattr(target, "_step_supports_amp_scaling", False) else None


def on_device_obstacle(optimizer: Optimizer, schedule: LRScheduler | None) -> str:
    """Why this optimizer and schedule cannot skip a step on the device; "" when they can."""
    if found_inf_taker(optimizer) is None:
        return f"{type(_applying(optimizer)).__name__} takes no found_inf input"
    if schedule is not None and not isinstance(schedule, WarmupDecaySchedule):
        return f"the LR scheduler {type(schedule).__name__} steps on the host"
    return ""


@contextlib.contextmanager
def skipping_when(optimizer: Optimizer, skip: torch.Tensor) -> Iterator[None]:
    """Inside, ``optimizer.step()`` changes nothing where ``skip`` is 1.0 (a device tensor)."""
    taker = found_inf_taker(optimizer)
    assert taker is not None, "prepare() chose the host for this optimizer"
    taker.found_inf = skip  # type: ignore[attr-defined]
    taker.grad_scale = None  # type: ignore[attr-defined]  # unscaled already
    try:
        yield
    finally:
        del taker.found_inf  # type: ignore[attr-defined]
        del taker.grad_scale  # type: ignore[attr-defined]
