"""The example's DemoTrainer without dropout, on a smaller corpus, for multi-rank parity runs
(``--user-script tests/scripts/deterministic_trainer.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from rapidformer import DataBundle
from rapidformer.cli import load_trainer_class

_Demo = load_trainer_class(
    str(Path(__file__).resolve().parents[2] / "examples" / "train_tiny_transformer.py")
)


class DeterministicTrainer(_Demo):  # type: ignore[valid-type, misc]
    dropout = 0.0

    def build_data(self) -> DataBundle:
        bundle = super().build_data()
        bundle.train = torch.utils.data.Subset(bundle.train, range(64))
        bundle.valid = torch.utils.data.Subset(bundle.valid, range(32))
        return bundle
