"""What a Trainer's train_step returns, checked once, on its first training output."""

from __future__ import annotations

from collections.abc import Mapping

from rapidformer.errors import HookError
from rapidformer.templates.batches import StepOutput, loss_of


def check_first_output(trainer: str, output: StepOutput, own_batch_weight: bool) -> None:
    """``trainer``'s first train_step output: what it returns cannot change kind later.
    ``own_batch_weight``: the Trainer overrides batch_weight."""
    if isinstance(output, Mapping) and "num_tokens" in output and not own_batch_weight:
        raise HookError(
            f"{trainer}.train_step returned num_tokens to weight micro-batches by tokens; the "
            "weights are now counted before the forward (so accumulation is exact without "
            "rescaling gradients afterwards): override batch_weight(batch) to return the token "
            "count, e.g. (batch['labels'] != -100).sum(), and drop num_tokens from "
            "train_step's output"
        )
    if not loss_of(output, "train_step").requires_grad:
        raise HookError(
            f"{trainer}.train_step returned a loss without gradient (requires_grad is False): "
            "compute it from self.model's outputs, without .detach(), .item() or "
            "torch.no_grad()"
        )
