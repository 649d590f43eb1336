"""The fused LM loss inside a Hugging Face causal LM's forward (``--fused-lm-loss``).

In training the patched forward (which then requires ``labels``) runs the base model for the
final hidden states (after the final norm) and hands them, the output embedding's weight and
the labels shifted by one to :func:`rapidformer.models.fused_loss.fused_linear_cross_entropy`;
it returns an output whose ``loss`` is that mean and whose ``logits`` are None. In
evaluation (and generation) the model's own forward runs, without the labels. Families whose
logits are exactly ``lm_head(hidden)`` only (:data:`FAMILIES`): no logit scaling or
soft-capping.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from rapidformer.models.forward_wrap import current_forward, owner_of
from rapidformer.models.fused_loss import fused_linear_cross_entropy, require_labels

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")
"""Causal-LM families whose logits are the output embedding of the last hidden states."""


class FusedLossOutput(dict[str, Any]):
    """What the patched forward returns in training: ``loss``, and no ``logits``."""

    @property
    def loss(self) -> Any:
        return self["loss"]

    @property
    def logits(self) -> None:
        return None


def supports(model: nn.Module) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in FAMILIES and hasattr(model, "get_output_embeddings")


def patch_forward(model: nn.Module) -> None:
    """Route the training forward with labels through the fused loss (in place)."""
    original = current_forward(model)  # weakly bound, as the model itself: see forward_wrap
    owner = owner_of(model)
    base = getattr(model, str(model.base_model_prefix))
    head = model.get_output_embeddings()  # type: ignore[operator]

    @functools.wraps(original)
    def forward(*args: Any, labels: Any = None, **kwargs: Any) -> Any:
        if not owner().training:
            return original(*args, **kwargs)
        labels = require_labels(owner(), labels)
        hidden = base(*args, **kwargs).last_hidden_state
        loss = fused_linear_cross_entropy(
            hidden[:, :-1], head.weight, head.bias, labels[:, 1:].contiguous()
        )
        return FusedLossOutput(loss=loss)

    model.forward = forward
