"""Steppers that look at a step's gradients around the run's own stepper.

Each wraps ``state.stepper`` after compose() and delegates both halves of the step to it
(:class:`rapidformer.state.Stepper`), looking at the gradients just before the stepper makes
them ready for the update (:meth:`WatchingStepper.before`) and at the state just after the
update (:meth:`WatchingStepper.after`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part
from rapidformer.memory import measured_bytes
from rapidformer.state import TrainState
from rapidformer.step.gradients import align_gradients
from rapidformer.step_io import FinishedGradients, StepResult


class WatchingStepper:
    """Delegates to the run's stepper; subclasses override :meth:`before` and :meth:`after`."""

    def __init__(self, state: TrainState) -> None:
        self.inner = state.stepper
        self.name = self.inner.name

    @property
    def skips_on_device(self) -> bool:
        return self.inner.skips_on_device

    def prepare(self, state: TrainState) -> Any:
        return self.inner.prepare(state)

    def finish_gradients(self, state: TrainState) -> FinishedGradients:
        self.before(state)
        return self.inner.finish_gradients(state)

    def update(
        self, state: TrainState, gradients: FinishedGradients, decision: Any, totals: Any
    ) -> StepResult:
        result = self.inner.update(state, gradients, decision, totals)
        self.after(state)
        return result

    def expected_bytes(self, state: TrainState) -> Any:
        return self.inner.expected_bytes(state)

    def before(self, state: TrainState) -> None:
        """The step's gradients, as the backward left them."""

    def after(self, state: TrainState) -> None:
        """The state once the update is applied."""


class RecordingGradients(WatchingStepper):
    """Copies every whole gradient (gathered where it is sharded) before the update, averaged
    over dp where no wrapper averaged it (what the stepper does first)."""

    def __init__(self, state: TrainState) -> None:
        super().__init__(state)
        self.grads: dict[str, torch.Tensor] = {}

    def before(self, state: TrainState) -> None:
        self.grads = {n: _full_grad(p) for n, p in state.unwrapped_model.named_parameters()}
        group = state.gradient_sync.average_group
        process_group.average_in_buckets(list(self.grads.values()), group)


class MeasuringBytes(WatchingStepper):
    """This rank's held bytes just before the first update (whole gradients or their shards)
    and just after it (optimizer state now exists)."""

    def __init__(self, state: TrainState) -> None:
        super().__init__(state)
        self.held: dict[str, int] = {}
        self._first = True

    def before(self, state: TrainState) -> None:
        if "gradients" not in self.held:
            self.held["gradients"] = measured_bytes(state.model, None).gradients

    def after(self, state: TrainState) -> None:
        if self._first:
            self._first = False
            after = measured_bytes(state.model, state.optimizer)
            self.held.update(parameters=after.parameters, optimizer=after.optimizer)


class GradientSizes(WatchingStepper):
    """How much of each gradient this rank holds just before the update (the stepper frees
    them after it), with their parameters' placements (what the stepper does first)."""

    def __init__(self, state: TrainState) -> None:
        super().__init__(state)
        self.sizes: dict[int, int] = {}

    def before(self, state: TrainState) -> None:
        align_gradients(state.parameters)
        self.sizes = {
            id(p): local_part(p.grad).numel() for p in state.parameters if p.grad is not None
        }


class Capturing:
    """A stepper that keeps the gradients and applies nothing."""

    name = "capture"
    skips_on_device = True  # nothing to read on the host

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def prepare(self, state: TrainState) -> None:
        return None

    def finish_gradients(self, state: TrainState) -> FinishedGradients:
        return FinishedGradients(norm=torch.zeros(()), overflow=None, lr=0.0)

    def update(
        self, state: TrainState, gradients: FinishedGradients, decision: Any, totals: Any
    ) -> StepResult:
        for name, param in state.unwrapped_model.named_parameters():
            if param.grad is not None:
                self.grads[name] = param.grad.clone()
        assert state.optimizer is not None
        state.optimizer.zero_grad(set_to_none=True)
        return StepResult.of(totals, grad_norm=0.0, lr=0.0, skipped=False)

    def expected_bytes(self, state: TrainState) -> Any:
        raise NotImplementedError


def _full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # DeepSpeed partitions
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param).detach().clone().float()
    assert param.grad is not None
    grad = param.grad
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
