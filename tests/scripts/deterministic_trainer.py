"""The example's DemoTrainer without dropout, on a smaller corpus, for multi-rank parity runs
(``--user-script tests/scripts/deterministic_trainer.py``)."""

from __future__ import annotations

from pathlib import Path

from rapidformer.cli import load_trainer_class

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_transformer.py"
_Demo = load_trainer_class(str(_EXAMPLE))


class DeterministicTrainer(_Demo):  # type: ignore[valid-type, misc]
    dropout = 0.0
    train_samples, valid_samples = 64, 32
