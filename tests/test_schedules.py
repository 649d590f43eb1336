"""Learning-rate warmup and decay follow the flags."""

from __future__ import annotations

import math

import pytest
import torch

from rapidformer import RapidformerConfig
from rapidformer.schedules import build_lr_scheduler


def _lrs(steps: int, **flags: object) -> list[float]:
    config = RapidformerConfig.from_dict({"lr": 1.0, "train_iters": steps, **flags})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, config, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_linear_warmup_then_linear_decay_to_min_lr() -> None:
    lrs = _lrs(10, lr_warmup_iters=2, min_lr=0.1)
    assert lrs[:2] == pytest.approx([0.5, 1.0])
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.1 + 0.9 * (1 - 4 / 8))
    assert lrs[-1] > 0.1


def test_cosine_decay_and_warmup_fraction() -> None:
    lrs = _lrs(20, lr_decay_style="cosine", lr_warmup_fraction=0.1)
    assert lrs[:2] == pytest.approx([0.5, 1.0])
    assert lrs[11] == pytest.approx(0.5 * (1 + math.cos(math.pi * 9 / 18)))


def test_constant() -> None:
    assert _lrs(5, lr_decay_style="constant") == pytest.approx([1.0] * 5)
