"""What crosses between a loop, the engine and the train state's slots in one step.

In: the user's micro-step as the slots call it (:class:`StepFunctions`: the loss of a
micro-batch and its weight, or the split form a pipeline needs), what a model is called with
(:data:`ModelInputs`, :func:`call_model`) and the loss helpers every slot shares. Between the
stepper's two halves: :class:`FinishedGradients`. Out: :class:`StepResult`, which the stepper
makes and the engine hands back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rapidformer.distributed.tensors import is_dtensor

ModelInputs = tuple[Any, ...] | Mapping[str, Any]
"""What a model's forward is called with: positional arguments, or keyword arguments."""


def call_model(model: Callable[..., Any], inputs: ModelInputs) -> Any:
    """``model(*inputs)`` or ``model(**inputs)``."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


@dataclass(frozen=True)
class StepFunctions:
    """The user's micro-step, as the forward-backward slot calls it.

    ``train_step(batch)`` returns the micro-batch's loss: the mean over its units (samples or
    tokens). ``weight(batch)`` returns how many units that is, from the batch alone, so that a
    step's weights are known before any forward. The split form, ``model_inputs(batch)`` (what
    the model's forward takes: positional or keyword arguments) and ``loss(outputs, batch)``, is
    what a pipeline needs: its first stage sees only the inputs, its last computes the loss.
    """

    train_step: Callable[[Any], torch.Tensor]
    weight: Callable[[Any], int | torch.Tensor]
    model_inputs: Callable[[Any], ModelInputs] | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a replicated DTensor (a vocab-parallel loss) becomes this
    rank's copy, still in the autograd graph."""
    if is_dtensor(loss):
        if not all(p.is_replicate() for p in loss.placements):
            from torch.distributed.tensor import Replicate  # loaded: a DTensor exists

            loss = loss.redistribute(placements=[Replicate()] * len(loss.placements))
        return loss.to_local()
    return loss


def whole(tensor: Any) -> Any:
    """A DTensor gathered into a plain tensor (e.g. vocabulary-sharded logits for a metric);
    anything else unchanged."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class FinishedGradients:
    """A step's gradients as the stepper made them ready for the update: what the step guard
    needs of them, and the learning rate the update will use."""

    norm: torch.Tensor | None
    """Global gradient norm before clipping (None where the stepper learns it only when it
    applies the update, e.g. DeepSpeed)."""
    overflow: torch.Tensor | None
    """fp16's found-inf count, summed over every rank (None without a loss scaler)."""
    lr: float | torch.Tensor
    """Learning rate the update uses."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: the stepper makes it, the engine hands it back.

    The loss, gradient norm, learning rate, weight and skip flag stay on the engine's device as
    0-dim tensors (``*_tensor``): reading one to the host waits for the device to finish the
    step, so the engine never does it inside a step and the loop reads them only when it logs.
    The properties (``loss``, ``grad_norm``, ``lr``, ``weight``, ``skipped``) read on access,
    for loops that want a number now. ``stop_requested`` is already on the host.
    """

    loss_tensor: torch.Tensor
    """Loss of the global batch: the count-weighted mean over all its micro-batches and ranks."""
    grad_norm_tensor: torch.Tensor
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step)."""
    lr_tensor: torch.Tensor
    """Learning rate the step used."""
    skipped_tensor: torch.Tensor
    """1.0 when the update was skipped: a non-finite loss or gradient on some rank (or an
    fp16 overflow the loss scaler found; the log names which when it reads the flags), else
    0.0."""
    weight_tensor: torch.Tensor
    """Units (samples or tokens) in the global batch."""
    stop_requested: bool = False
    """Every rank agreed to stop after this step: a stop signal arrived (``Trainer.fit``
    saves a checkpoint and ends the run). On several ranks the agreement is read one step
    after the signal arrived (the read never waits for the device)."""
    skipped_on_host: bool | None = None
    """The skip as the host decided it, for a stepper that reads the decision first (reading
    it costs nothing); None where the step was decided on the device."""

    @classmethod
    def of(
        cls,
        totals: torch.Tensor,
        *,
        grad_norm: float | torch.Tensor,
        lr: float | torch.Tensor,
        skipped: bool | torch.Tensor,
        stop: bool = False,
    ) -> StepResult:
        """The step's numbers as tensors, with no host read. ``totals`` is ``[weight, weighted
        loss sum]`` over every data-parallel rank: the units (samples or tokens) of the global
        batch, and the sum of the micro-batches' losses times their units; ``skipped`` is a
        host bool or the device's flag."""
        weight, loss_sum = totals.detach().unbind()
        return cls(
            loss_tensor=loss_sum.float() / weight.clamp(min=1e-12),
            grad_norm_tensor=torch.as_tensor(grad_norm, dtype=torch.float32).detach(),
            lr_tensor=(
                lr.detach()
                if isinstance(lr, torch.Tensor)
                else torch.tensor(lr, dtype=torch.float64)  # a host float stays exact
            ),
            skipped_tensor=torch.as_tensor(skipped, dtype=torch.float32),
            weight_tensor=weight,
            stop_requested=stop,
            skipped_on_host=skipped if isinstance(skipped, bool) else None,
        )

    @property
    def applied(self) -> bool | torch.Tensor:
        """Whether the update was applied: a host bool where the host decided, else 1.0 or
        0.0 on the device (no read)."""
        if self.skipped_on_host is not None:
            return not self.skipped_on_host
        return 1.0 - self.skipped_tensor

    @property
    def loss(self) -> float:
        """:attr:`loss_tensor` read to the host (waits for the step)."""
        return float(self.loss_tensor)

    @property
    def grad_norm(self) -> float:
        """:attr:`grad_norm_tensor` read to the host (waits for the step)."""
        return float(self.grad_norm_tensor)

    @property
    def lr(self) -> float:
        """:attr:`lr_tensor` read to the host (waits for the step where it is on a device)."""
        return float(self.lr_tensor)

    @property
    def skipped(self) -> bool:
        """:attr:`skipped_tensor` read to the host (waits for a step decided on the device)."""
        if self.skipped_on_host is not None:
            return self.skipped_on_host
        return bool(self.skipped_tensor > 0)

    @property
    def weight(self) -> float:
        """:attr:`weight_tensor` read to the host (waits for the step)."""
        return float(self.weight_tensor)
