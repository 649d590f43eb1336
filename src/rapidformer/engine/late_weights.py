"""Hand-written loops whose micro-batch weights are known only after each forward.

``engine.backward(loss, weight=...)`` per micro-batch and ``engine.step()`` at the end (the
shape of most hand-written PyTorch loops, and of :mod:`rapidformer.compat.pai`) run through
:class:`LateWeights`, a thin adapter over the same slots ``run_step`` uses. The step's total
weight is known only at its last micro-batch, so earlier backwards are scaled by
``weight / (reference x accumulation steps)``, with a reference common to the ranks (the
first micro-batch's mean weight over dp); when the total differs from what that assumed, the
gradients accumulated so far are rescaled once before the last backward. ``run_step``, which
counts every micro-batch before its forward, never needs that rescale.

DDP decides in a micro-batch's *forward* whether its backward all-reduces, so the adapter arms
the slot for the coming micro-batch ahead of it: after compose, after each backward and after
each step (``begin_micro_step`` when a step has fewer micro-batches than the accumulation
steps, e.g. an epoch's last).
"""

from __future__ import annotations

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import HookError
from rapidformer.state import MicroStepBackward, TrainState


class LateWeights:
    """Accumulation bookkeeping of one step's ``backward(loss, weight)`` calls over a
    composed ``state``; see the module docstring."""

    def __init__(self, state: TrainState, dp: int, accumulation_steps: int) -> None:
        self.state = state
        slot = state.forward_backward
        self.slot = slot if isinstance(slot, MicroStepBackward) else None
        """None for a slot that runs whole steps only (a pipeline schedule)."""
        self.dp = dp
        self.accumulation_steps = accumulation_steps
        self.micro_steps = 0
        self.ready = False
        """True once the step's last micro-batch ran backward: ``step()`` may apply it."""
        self.reference = torch.ones((), device=state.device)
        self.totals = torch.zeros(2, device=state.device)  # [weight, weight x loss] so far
        self.step_totals = self.totals  # the same, summed over ranks, once the step is ready
        self.last_armed = False
        self.arm()

    def arm(self, last: bool | None = None) -> None:
        """Declare whether the coming micro-batch ends the step (default: a fresh step's
        first micro-batch ends it only without accumulation)."""
        self.last_armed = self.accumulation_steps == 1 if last is None else last
        if self.slot is not None:
            self.slot.arm(self.state, self.last_armed)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor) -> None:
        state, slot = self.state, self._micro_step_slot()
        dp_group = state.mesh.group("dp")
        count = torch.as_tensor(weight, dtype=torch.float32, device=state.device)
        self.micro_steps += 1
        self.totals += torch.stack([count, loss.detach().float() * count])
        if self.micro_steps == 1:
            common = process_group.all_reduce_sum(count.clone(), dp_group) / self.dp
            self.reference = common.clamp(min=1.0)
        if not self.last_armed:
            factor = count / (self.reference * self.accumulation_steps)
            state.moe.set_current_scale(factor)
            slot.backward(state, loss * factor)
            self.arm(self.micro_steps + 1 == self.accumulation_steps)
            return
        totals = process_group.all_reduce_sum(self.totals.clone(), dp_group)
        total = totals[0].clamp(min=1e-12)
        if self.micro_steps > 1:
            assumed = self.reference * self.accumulation_steps * self.dp
            slot.rescale_gradients(state, assumed / total)
        state.moe.set_current_scale(count * self.dp / total)
        slot.backward(state, loss * (count * self.dp / total))
        self.step_totals = totals
        self.ready = True

    def finish(self) -> torch.Tensor:
        """The ready step's ``[weight, weighted loss sum]`` over all ranks; starts a new
        step."""
        totals = self.step_totals
        self.micro_steps = 0
        self.ready = False
        self.totals = torch.zeros_like(self.totals)
        return totals

    def _micro_step_slot(self) -> MicroStepBackward:
        if self.slot is None:
            raise HookError(
                f"under {self.state.forward_backward.name} a step's forwards and backwards run "
                "inside the schedule: call engine.run_step(batches, StepFunctions(...)) with "
                "model_inputs and loss, not engine.backward(loss)"
            )
        return self.slot
