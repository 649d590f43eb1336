"""A tiny LM, token-weighted samples of uneven lengths, and gradient comparison: the pieces
the accumulation and mesh tests share."""

from __future__ import annotations

import torch

from rapidformer.labels import IGNORE_INDEX
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM

TOLERANCE = 1e-6  # fp32, max abs difference of any gradient element


def tiny_lm() -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=64)


def uneven_samples(count: int = 8) -> list[dict[str, torch.Tensor]]:
    """Lengths 4..40: micro-batches of two pad to very different lengths and token counts."""
    dataset = MarkovLMDataset(count, vocab_size=64, min_length=4, max_length=40, seed=3)
    return [dataset[i] for i in range(count)]


def tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)
