"""Learning-rate warmup and decay follow the flags."""

from __future__ import annotations

import math

import pytest
import torch

from rapidformer import RapidformerConfig
from rapidformer.schedules import Shape, build_lr_scheduler


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


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_the_device_count_gives_the_host_schedule(style: str) -> None:
    shape = Shape(total=20, warmup=3, style=style, min_ratio=0.1)
    steps = torch.arange(25, dtype=torch.float64)
    on_device = shape.factor_tensor(steps).tolist()
    on_host = [shape.factor(s) for s in range(25)]
    assert max(abs(a - b) for a, b in zip(on_device, on_host, strict=True)) <= 1e-15


def test_a_skipped_step_does_not_advance_the_device_schedule_and_it_checkpoints() -> None:
    config = RapidformerConfig.from_dict({"lr": 1.0, "lr_warmup_iters": 4, "train_iters": 10})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, config, 10)
    scheduler.count_on_device(torch.device("cpu"))
    lrs = [float(optimizer.param_groups[0]["lr"])]
    for applied in (1.0, 0.0, 1.0):  # the second step was skipped
        scheduler.step(applied=torch.tensor(applied))
        lrs.append(float(optimizer.param_groups[0]["lr"]))
    assert lrs == pytest.approx([0.25, 0.5, 0.5, 0.75])
    saved = scheduler.state_dict()
    assert saved["last_epoch"] == 2
    again = build_lr_scheduler(optimizer, config, 10)
    again.count_on_device(torch.device("cpu"))
    again.load_state_dict(saved)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.75)
    again.step(applied=torch.tensor(1.0))
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(1.0)
