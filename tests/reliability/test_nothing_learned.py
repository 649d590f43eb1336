"""A run that learned nothing does not succeed: when every step was skipped it ends with exit 3
naming the cause (the loss, or a weight that is not finite), and writes no checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer.checkpoint import find_checkpoint
from rapidformer.cli import main
from tests.helpers.trainers import ROOT, TINY_FLAGS

FAULTY = ROOT / "tests" / "scripts" / "faulty_trainer.py"
RUN = ["--user-script", str(FAULTY), *TINY_FLAGS, "--train-iters", "3", "--micro-batch-size", "4"]


def test_a_run_whose_every_step_was_skipped_fails_naming_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fewer steps than --max-skipped-steps, each skipped (a NaN loss): exit 3, not 0. A NaN
    in a frozen base is refused before training (the catalogue's adapter-base-holds-nan)."""
    monkeypatch.setenv("FAULT_NAN", "1-3:0")
    save = tmp_path / "run"
    assert main([*RUN, "--save", str(save)]) == 3
    error = capsys.readouterr().err
    assert "every one of this run's 3 steps was skipped" in error, error
    assert "every step's loss or gradients were not finite. Fix: lower --lr" in error
    assert find_checkpoint(save) is None


def test_a_run_with_one_step_applied_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT_NAN", "1-2:0")  # the third step is applied
    assert main([*RUN, "--save", str(tmp_path / "run")]) == 0
    assert find_checkpoint(tmp_path / "run") is not None
