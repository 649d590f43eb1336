"""The Trainer loop: epochs, the optimizer's parameter groups, and what fit() returns."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from rapidformer.accel.optim.optimizers import parameter_groups
from rapidformer.testing import TinyTransformerLM
from tests.helpers.trainers import read_losses, tiny_trainer


def test_epochs_visit_every_sample_once_per_epoch_with_a_short_last_step(tmp_path: Path) -> None:
    # 64 samples, micro 4, global 12: 5 full steps and one 1-micro-batch step per epoch.
    trainer = tiny_trainer(
        "--epochs",
        "2",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "12",
        "--save",
        str(tmp_path),
    )
    seen: Counter[bytes] = Counter()
    original = trainer.train_step

    def train_step(batch: Any) -> Any:
        assert trainer.model is not None
        if trainer.model.training:
            for row in batch["input_ids"]:
                seen[row[row != 0].numpy().tobytes()] += 1  # padding (id 0) stripped
        return original(batch)

    trainer.train_step = train_step  # type: ignore[method-assign]
    metrics = trainer.fit()
    assert sorted(read_losses(tmp_path)) == list(range(1, 13))
    assert len(seen) == 64 and set(seen.values()) == {2}  # every sample, once per epoch
    assert set(metrics) == {"train_loss", "eval_loss"}


def test_weight_decay_skips_biases_and_norms() -> None:
    model = TinyTransformerLM()
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    no_decay_names = {names[id(p)] for p in no_decay["params"]}  # type: ignore[attr-defined]
    assert no_decay_names == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert "blocks.0.norm1.weight" in no_decay_names and "blocks.0.qkv.bias" in no_decay_names
    assert all(names[id(p)].endswith("weight") for p in decay["params"])  # type: ignore[attr-defined]


def test_fused_adamw_is_built_and_named_in_the_plan() -> None:
    trainer = tiny_trainer("--train-iters", "1")
    state = trainer.engine.compose(trainer.build_model())
    assert isinstance(state.optimizer, torch.optim.AdamW)
    assert state.optimizer.defaults["fused"] is True
    assert any("torch.optim.AdamW(fused=True)" in str(step) for step in state.plan)


def test_evaluation_does_not_change_training_randomness(tmp_path: Path) -> None:
    # Dropout draws from the global RNG; an evaluation must not move it.
    runs = {}
    for name, flags in {
        "often": ["--eval-interval", "1"],
        "never": ["--eval-interval", "100"],
    }.items():
        tiny_trainer(
            "--train-iters",
            "6",
            "--micro-batch-size",
            "8",
            "--save",
            str(tmp_path / name),
            *flags,
            dropout=0.1,
        ).fit()
        runs[name] = read_losses(tmp_path / name)
    assert runs["often"] == runs["never"]
