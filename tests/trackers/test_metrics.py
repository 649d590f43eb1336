"""Rank 0 writes metrics.jsonl and TensorBoard events with the same numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer.templates.batches import batch_tokens
from tests.helpers.trainers import tiny_trainer


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


@pytest.mark.parametrize(
    ("batch", "tokens"),
    [
        (
            {
                "input_ids": torch.ones(2, 5),
                "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]]),
            },
            7,
        ),
        ({"input_ids": torch.ones(2, 5), "labels": torch.tensor([[1, -100, 2, 3, -100]] * 2)}, 6),
        ({"text": torch.zeros(3, 17, dtype=torch.long)}, 51),  # Megatron's GPT samples
        ({"tokens": torch.zeros(2, 4, dtype=torch.long), "weights": torch.ones(2, 4)}, 8),
        ({"pixels": torch.ones(2, 3, 4)}, 0),  # nothing that counts tokens
    ],
)
def test_throughput_counts_the_tokens_a_batch_feeds(batch: dict[str, Any], tokens: int) -> None:
    assert int(batch_tokens(batch)) == tokens


def test_console_log_lines_go_to_the_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notebooks and test runners replace ``sys.stderr``; a handler that kept the stream of its
    set-up wrote into a closed file after the next replacement ("--- Logging error ---")."""
    import io
    import sys

    from rapidformer.log import log, setup_console_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(log, "handlers", [])  # set-up state restored afterwards
    monkeypatch.setattr(log, "propagate", log.propagate)
    monkeypatch.setattr(log, "level", log.level)
    monkeypatch.setattr(sys, "stderr", first)
    setup_console_logging()
    log.info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("two")
    assert second.getvalue() == "[rapidformer] two\n"
    chosen = io.StringIO()
    log.handlers[0].setStream(chosen)  # type: ignore[attr-defined]  # kept as given
    log.info("three")
    assert (chosen.getvalue(), second.getvalue()) == (
        "[rapidformer] three\n",
        "[rapidformer] two\n",
    )
