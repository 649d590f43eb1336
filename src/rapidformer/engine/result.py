"""What one optimizer step did, as the engine hands it back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidformer.state import StepOutcome


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    The loss, gradient norm and weight stay on the engine's device as 0-dim tensors
    (``*_tensor``): reading one to the host waits for the device to finish the step, so the
    engine never does it and the loop reads them only when it logs. The float properties
    (``loss``, ``grad_norm``, ``weight``) read on access, for loops that want a number now.
    ``skipped`` and ``stop_requested`` are the step's agreed decision, already on the host.
    """

    loss_tensor: torch.Tensor
    """Loss of the global batch: the count-weighted mean over all its micro-batches and ranks."""
    grad_norm_tensor: torch.Tensor
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step)."""
    lr: float
    """Learning rate the step used."""
    skipped: bool
    """True when the update was skipped: a non-finite loss or gradient on some rank (or an
    fp16 overflow the loss scaler found); ``skip_reason`` says which."""
    weight_tensor: torch.Tensor
    """Units (samples or tokens) in the global batch."""
    stop_requested: bool = False
    """Every rank agreed to stop after this step: a stop signal arrived (``Trainer.fit``
    saves a checkpoint and ends the run)."""
    skip_reason: str = ""

    @property
    def loss(self) -> float:
        """:attr:`loss_tensor` read to the host (waits for the step)."""
        return float(self.loss_tensor)

    @property
    def grad_norm(self) -> float:
        """:attr:`grad_norm_tensor` read to the host (waits for the step)."""
        return float(self.grad_norm_tensor)

    @property
    def weight(self) -> float:
        """:attr:`weight_tensor` read to the host (waits for the step)."""
        return float(self.weight_tensor)


def step_result(outcome: StepOutcome, loss_sum: torch.Tensor, weight: torch.Tensor) -> StepResult:
    """The step's numbers as device tensors (no host read): ``loss_sum`` is the sum of the
    micro-batches' losses times their weights, over every data-parallel rank."""
    grad_norm = torch.as_tensor(outcome.grad_norm, dtype=torch.float32)
    return StepResult(
        loss_tensor=loss_sum.detach().float() / weight.clamp(min=1e-12),
        grad_norm_tensor=grad_norm.detach(),
        lr=outcome.lr,
        skipped=outcome.skipped,
        weight_tensor=weight.detach(),
        stop_requested=outcome.stop,
        skip_reason=outcome.reason,
    )
