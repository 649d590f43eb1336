"""An interrupted run resumes from its last checkpoint and continues bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer.checkpoint import find_checkpoint
from rapidformer.errors import CheckpointError
from tests.helpers.trainers import read_losses, tiny_trainer

FLAGS = (
    "--train-iters",
    "10",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--save-interval",
    "5",
    "--eval-interval",
    "5",
)


class Crash(Exception):
    pass


def _crashing_fit(save: Path, crash_after_steps: int) -> None:
    trainer = tiny_trainer(*FLAGS, "--save", str(save), dropout=0.1)
    original = trainer.train_step
    calls = {"n": 0}

    def train_step(batch: Any) -> Any:
        assert trainer.model is not None
        calls["n"] += trainer.model.training  # evaluation calls train_step too; not counted
        if calls["n"] > crash_after_steps * 2:  # two micro-batches per step
            raise Crash
        return original(batch)

    trainer.train_step = train_step  # type: ignore[method-assign]
    with pytest.raises(Crash):
        trainer.fit()


def test_resume_after_a_crash_reproduces_the_uninterrupted_losses_bitwise(tmp_path: Path) -> None:
    # Dropout 0.1 and shuffled data: a resume that lost RNG or data position would differ.
    uninterrupted = tmp_path / "full"
    tiny_trainer(*FLAGS, "--save", str(uninterrupted), dropout=0.1).fit()

    resumed = tmp_path / "resumed"
    _crashing_fit(resumed, crash_after_steps=7)  # dies in step 8; last checkpoint is step 5
    assert find_checkpoint(resumed) == resumed / "iter_0000005"
    tiny_trainer(*FLAGS, "--save", str(resumed), dropout=0.1).fit()  # finds it and resumes

    full, again = read_losses(uninterrupted), read_losses(resumed)
    for step in range(6, 11):
        assert again[step] == full[step], f"step {step}: {again[step]!r} != {full[step]!r}"
    assert read_losses(uninterrupted, "eval")[10] == read_losses(resumed, "eval")[10]
    final_a = torch.load(uninterrupted / "iter_0000010" / "model.pt")
    final_b = torch.load(resumed / "iter_0000010" / "model.pt")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_load_from_an_explicit_iteration_directory(tmp_path: Path) -> None:
    first = tmp_path / "first"
    tiny_trainer(*FLAGS, "--save", str(first)).fit()
    # Resume from step 5 of the first run into a new save directory.
    second = tmp_path / "second"
    tiny_trainer(*FLAGS, "--save", str(second), "--load", str(first / "iter_0000005")).fit()
    assert sorted(read_losses(second)) == [6, 7, 8, 9, 10]
    assert read_losses(second)[10] == read_losses(first)[10]


def test_rerunning_a_command_with_load_continues_from_its_own_save(tmp_path: Path) -> None:
    # A run started from --load X and interrupted after writing its own checkpoint to --save Y
    # is rerun as the same command: it continues from Y (step 5), not from X (step 10) again.
    first, second = tmp_path / "first", tmp_path / "second"
    tiny_trainer(*FLAGS, "--save", str(first)).fit()
    _crashing_fit(second, crash_after_steps=7)  # its own run: a checkpoint at step 5 in Y
    more = [*FLAGS[:1], "20", *FLAGS[2:]]
    tiny_trainer(*more, "--save", str(second), "--load", str(first)).fit()
    losses = read_losses(second)
    assert find_checkpoint(second) == second / "iter_0000020"
    # From Y's step 5: steps 6.. logged again after the crash; from X it would start at 11.
    assert min(step for step in losses if step > 5) == 6 and 11 in losses


def test_load_without_a_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        tiny_trainer(*FLAGS, "--load", str(tmp_path)).fit()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--num-attention-heads", "8"), "--num-attention-heads 4 there, 8 now"),
        (("--seed", "2"), "--seed 1234 there, 2 now"),
    ],
)
def test_a_checkpoint_of_other_heads_or_another_seed_is_refused_by_name(
    tmp_path: Path, flags: tuple[str, ...], named: str
) -> None:
    """Eight heads of 4 read the tensors of four heads of 8 without an error (the shapes
    agree), and another seed is another run: both refused before anything is read."""
    first = tmp_path / "first"
    tiny_trainer(*FLAGS, "--save", str(first)).fit()
    before = (first / "iter_0000010" / "model.pt").stat().st_mtime_ns
    other = tiny_trainer(*FLAGS, *flags, "--save", str(first))
    with pytest.raises(CheckpointError, match=f"was written by another run \\({named}"):
        other.fit()
    assert (first / "iter_0000010" / "model.pt").stat().st_mtime_ns == before
