"""Rank 0 writes metrics.jsonl and TensorBoard events with the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_trainer


def test_metrics_jsonl_and_tensorboard_agree(tmp_path: Path) -> None:
    tiny_trainer(
        "--train-iters",
        "6",
        "--micro-batch-size",
        "8",
        "--log-interval",
        "2",
        "--eval-interval",
        "3",
        "--save",
        str(tmp_path),
    ).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "peak_memory_mb"):
        assert all(r[key] > 0 for r in train), key
    # 8 samples per step: samples/s and tokens/s must be consistent with the step time.
    assert all(r["tokens_per_s"] > r["samples_per_s"] for r in train)

    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [2, 4, 6]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/eval_loss")] == [3, 6]
