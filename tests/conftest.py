"""Shared fixtures: small configs and the example Trainer used across tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer import parse_args
from rapidformer.cli import load_trainer_class
from rapidformer.templates.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny_transformer.py"

TINY_FLAGS = [
    "--lr",
    "3e-3",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "24",
    "--max-position-embeddings",
    "32",
    "--log-interval",
    "1",
    "--clip-grad",
    "1.0",
]


@pytest.fixture(autouse=True)
def _deterministic_threads() -> None:
    # Two cores: one intra-op thread keeps reductions in a fixed order and leaves room for the
    # second rank of distributed tests.
    torch.set_num_threads(1)


MODEL_SHAPE = {
    # The tiny built-in GPT/BERT shape the model tests share.
    "vocab_size": 100,
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
}

DETERMINISTIC_SCRIPT = ROOT / "tests" / "scripts" / "deterministic_trainer.py"


def tiny_trainer(*flags: str, dropout: float = 0.0) -> Trainer:
    """The example's DemoTrainer on 64 training samples, configured by ``flags``."""
    cls = load_trainer_class(str(DETERMINISTIC_SCRIPT))
    trainer_class = type("Tiny", (cls,), {"dropout": dropout})
    return trainer_class(parse_args([*TINY_FLAGS, *flags]))


def read_losses(save_dir: Path, kind: str = "train") -> dict[int, float]:
    """Step -> loss from a run's metrics.jsonl (JSON floats round-trip exactly)."""
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    key = "loss" if kind == "train" else "eval_loss"
    return {r["step"]: r[key] for r in records if r["kind"] == kind}
