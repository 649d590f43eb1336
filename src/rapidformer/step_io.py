"""What crosses between a loop, the engine and the train state's slots in one step.

In: the user's micro-step as the slots call it (:class:`StepFunctions`: the loss of a
micro-batch and its weight, or the split form a pipeline needs), what a model is called with
(:data:`ModelInputs`, :func:`call_model`) and the loss helpers every slot shares. Between the
stepper's two halves: :class:`FinishedGradients`. Out: :class:`StepOutcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

IGNORE_INDEX = -100
"""The label a loss skips: torch's cross-entropy default, and every task's and collate's."""

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
    if isinstance(loss, DTensor):
        if not all(p.is_replicate() for p in loss.placements):
            loss = loss.redistribute(placements=[Replicate()] * len(loss.placements))
        return loss.to_local()
    return loss


def whole(tensor: Any) -> Any:
    """A DTensor gathered into a plain tensor (e.g. vocabulary-sharded logits for a metric);
    anything else unchanged."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


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
class StepOutcome:
    """What the stepper did with one step's gradients. Where the step was decided on the
    device, its numbers and its skip flag are 0-dim device tensors (reading one waits)."""

    grad_norm: float | torch.Tensor
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step)."""
    lr: float | torch.Tensor
    """Learning rate the step used."""
    skipped: bool | torch.Tensor
    """True (1.0) when the step was not applied (a non-finite loss or gradient, or an fp16
    overflow)."""
    stop: bool = False
    """True when every rank agreed to stop after this step (a stop signal arrived)."""
