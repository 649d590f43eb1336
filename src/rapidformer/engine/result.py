"""What one optimizer step did, as the engine hands it back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidformer.step_io import StepOutcome


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

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
        """:attr:`skipped_tensor` read to the host (waits for the step)."""
        return bool(self.skipped_tensor > 0)

    @property
    def weight(self) -> float:
        """:attr:`weight_tensor` read to the host (waits for the step)."""
        return float(self.weight_tensor)


def step_result(outcome: StepOutcome, loss_sum: torch.Tensor, weight: torch.Tensor) -> StepResult:
    """The step's numbers as tensors (no host read): ``loss_sum`` is the sum of the
    micro-batches' losses times their weights, over every data-parallel rank."""
    return StepResult(
        loss_tensor=loss_sum.detach().float() / weight.clamp(min=1e-12),
        grad_norm_tensor=torch.as_tensor(outcome.grad_norm, dtype=torch.float32).detach(),
        lr_tensor=(
            outcome.lr.detach()
            if isinstance(outcome.lr, torch.Tensor)
            else torch.tensor(outcome.lr, dtype=torch.float64)  # a host float stays exact
        ),
        skipped_tensor=torch.as_tensor(outcome.skipped, dtype=torch.float32),
        weight_tensor=weight.detach(),
        stop_requested=outcome.stop,
    )
