"""The dynamic-shape iterator: a bounded set of shapes, less padding, the same loss on the same
samples, a deterministic and resumable order, and a visible fallback when lengths are equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from rapidformer.data.dynamic_shape import LengthGroupedSampler, bucket_for, bucket_lengths
from rapidformer.errors import ConfigError
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from tests.helpers.trainers import read_losses, tiny_trainer


def test_bucket_lengths_are_few_multiples_of_8() -> None:
    assert bucket_lengths(512) == [8, 16, 32, *range(64, 513, 64)]
    assert bucket_lengths(24) == [8, 16, 24]
    assert all(b % 8 == 0 for b in bucket_lengths(1024)) and len(bucket_lengths(1024)) == 12
    assert bucket_for(65, bucket_lengths(512)) == 128 and bucket_for(8, [8, 16]) == 8


def test_grouped_order_is_a_deterministic_resumable_permutation() -> None:
    lengths = np.random.RandomState(0).randint(1, 100, size=1000)
    sampler = LengthGroupedSampler(lengths, 4, dp_rank=1, dp_size=2, seed=3)
    other = LengthGroupedSampler(lengths, 4, dp_rank=0, dp_size=2, seed=3)
    order = list(sampler)
    assert sorted(order + list(other)) == list(range(1000))  # the two ranks: every sample once
    assert order == list(LengthGroupedSampler(lengths, 4, dp_rank=1, dp_size=2, seed=3))
    sampler.set_position(0, 40)  # resumed after 10 micro-batches
    assert list(sampler) == order[40:]
    batches = [lengths[order[i : i + 4]] for i in range(0, len(order), 4)]
    spread = np.mean([b.max() - b.min() for b in batches])
    assert spread < 10  # grouped: lengths within a batch are close (random batches: ~70)


def test_loss_is_the_same_whatever_the_padding() -> None:
    torch.manual_seed(0)
    model = TinyTransformerLM(max_positions=64)
    data = MarkovLMDataset(8, min_length=5, max_length=20, seed=2)
    samples = [data[i] for i in range(8)]
    fixed = lm_loss(model, pad_collate(samples, pad_to=64))["loss"]
    bucketed = lm_loss(model, pad_collate(samples, pad_to=bucket_for(20, bucket_lengths(64))))
    assert abs(fixed.item() - bucketed["loss"].item()) <= 1e-6


def test_trainer_with_dynamic_shape_uses_few_shapes_and_learns(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        "--train-iters",
        "40",
        "--micro-batch-size",
        "8",
        "--data-iterator",
        "dynamic-shape",
        "--save",
        str(tmp_path),
    )
    trainer.fit()
    plan = [str(step) for step in trainer.engine.state.plan]  # type: ignore[union-attr]
    assert any(
        "dynamic shape: length-grouped batches padded to 3 buckets [8, 16, 24]" in p for p in plan
    ), plan
    loader = trainer.engine.state.train_dataloader  # type: ignore[union-attr]
    assert loader is not None and loader.collate_fn.shapes_seen <= {8, 16, 24}
    losses = read_losses(tmp_path)
    assert losses[40] < losses[1] - 1.0


def test_equal_lengths_fall_back_visibly() -> None:
    trainer = tiny_trainer("--train-iters", "1", "--data-iterator", "dynamic-shape")
    data = MarkovLMDataset(16, min_length=24, max_length=24)
    loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=pad_collate)
    state = trainer.engine.compose(trainer.build_model(), train_dataloader=loader)
    assert any(
        "dynamic-shape requested, but every sample has 24 tokens" in str(p) for p in state.plan
    )


def test_datasets_without_lengths_are_refused() -> None:
    trainer = tiny_trainer("--train-iters", "1", "--data-iterator", "dynamic-shape")
    loader = DataLoader(list(range(8)), batch_size=4)
    with pytest.raises(ConfigError, match="needs a training dataset with a `lengths` attribute"):
        trainer.engine.compose(trainer.build_model(), train_dataloader=loader)
