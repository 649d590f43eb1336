"""Stop signals and non-finite steps in one process: a signal ends the run after a checkpoint
at the step reached and the rerun continues bit for bit; a NaN loss skips its step without
moving anything; too many skips in a row stop the run with its last checkpoint intact."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidformer import parse_args
from rapidformer.checkpoint import find_checkpoint
from rapidformer.cli import load_trainer_class
from rapidformer.errors import NonFiniteError, Preempted
from rapidformer.reliability import rising
from rapidformer.reliability.rising import RisingLoss
from rapidformer.reliability.spikes import SpikeDetector
from tests.helpers.trainers import ROOT, TINY_FLAGS, read_losses

FAULTY = ROOT / "tests" / "scripts" / "faulty_trainer.py"
RUN = ("--train-iters", "12", "--micro-batch-size", "4", "--global-batch-size", "8")


def _fit(save: Path | None, *flags: str) -> dict[str, float]:
    save_flags = [] if save is None else ["--save", str(save)]
    trainer = load_trainer_class(str(FAULTY))(parse_args([*TINY_FLAGS, *RUN, *flags, *save_flags]))
    try:
        return trainer.fit()
    finally:
        trainer.engine.close()


def _model(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "model.pt")


def _assert_same_final_weights(a: Path, b: Path) -> None:
    final_a, final_b = _model(a / "iter_0000012"), _model(b / "iter_0000012")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("uninterrupted")
    torch.set_num_threads(1)
    _fit(save)
    return save


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_stop_signal_saves_at_the_step_reached_and_the_rerun_continues_bitwise(
    signal_name: str, uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = random.Random(signal_name).randint(2, 10)  # a seeded "random" step per signal
    monkeypatch.setenv("FAULT_SIGNAL", f"{step}:0:{signal_name}")
    with pytest.raises(Preempted, match=rf"stopped at step {step} of 12 .*{signal_name}"):
        _fit(tmp_path)  # no --save-interval: the signal alone makes the checkpoint
    assert find_checkpoint(tmp_path) == tmp_path / f"iter_{step:07d}"
    monkeypatch.delenv("FAULT_SIGNAL")
    _fit(tmp_path)
    full, resumed = read_losses(uninterrupted), read_losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(step + 1, 13))
    _assert_same_final_weights(uninterrupted, tmp_path)


def test_the_command_exits_75_on_sigterm_and_warns_without_save(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "rapidformer", "--user-script", str(FAULTY)]
    command += [*TINY_FLAGS, *RUN]
    env = {**os.environ, "FAULT_SIGNAL": "3:0:SIGTERM", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*command, "--save", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 75, run.stderr[-2000:]
    assert "stopped at step 3 of 12" in run.stderr and "Traceback" not in run.stderr
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
    # Without --save the run says at start that a signal would lose it, and dies of it.
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert "no --save: no model or checkpoint of this run will be written" in run.stderr
    assert run.returncode == -15  # SIGTERM's default action


def _digests(directory: Path) -> dict[int, str]:
    rows = [json.loads(line) for line in (directory / "rank_0.jsonl").read_text().splitlines()]
    return {row["step"]: row["digest"] for row in rows}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_nan_loss_skips_the_step_and_moves_nothing(
    precision: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("FAULT_NAN", "3:0")
    monkeypatch.setenv("FAULT_DIGESTS", str(tmp_path))
    save = tmp_path / "run"
    _fit(save, "--precision", precision, "--save-interval", "1")
    digests = _digests(tmp_path)
    assert digests[4] == digests[3] != digests[2]  # step 3 changed no parameter
    two, three = save / "iter_0000002", save / "iter_0000003"
    opt_two, opt_three = torch.load(two / "optimizer.pt"), torch.load(three / "optimizer.pt")
    for key, moments in opt_two["state"].items():
        assert all(torch.equal(v, opt_three["state"][key][k]) for k, v in moments.items())
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert lr[4] == lr[3]  # the schedule did not advance on the skipped step
    assert "step 3 skipped: non-finite loss on rank 0" in caplog.text
    losses = read_losses(save)
    assert all(torch.isfinite(torch.tensor(losses[s])) for s in range(4, 13))


def test_consecutive_skips_stop_the_run_with_its_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT_NAN", "4-12:0")
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps skipped, the last at step 6"):
        _fit(tmp_path, "--save-interval", "2", "--max-skipped-steps", "3")
    # Step 4's checkpoint holds the weights of step 3 (step 4 was skipped): both intact.
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    three_steps = _model(tmp_path / "iter_0000004")
    assert all(torch.isfinite(v).all() for v in three_steps.values())


def test_a_loss_spike_is_detected_after_the_warmup_and_not_before() -> None:
    detector = SpikeDetector(window=20, factor=10.0)
    early = [detector.spike(v) for v in (50.0, 5.0, 4.0)]  # the first losses fall fast
    assert early == [None, None, None]
    for _ in range(10):
        assert detector.spike(2.0) is None
    ratio = detector.spike(80.0)  # recent mean (50 + 5 + 4 + 10 x 2) / 13 = 6.08
    assert ratio is not None and abs(ratio - 80.0 / (79.0 / 13)) < 1e-9
    assert detector.spike(float("nan")) is None  # the guard's business, not a spike


def test_a_loss_that_keeps_rising_after_warmup_is_said_once_naming_the_lr() -> None:
    watch = RisingLoss(warmup_steps=5, lr=0.01)
    assert all(watch.rising(step, 100.0 + step) is None for step in range(1, 6))  # warmup
    noisy = [2.0 + 0.3 * ((step * 7) % 5) for step in range(6, 66)]  # no trend: never
    assert all(watch.rising(step, loss) is None for step, loss in enumerate(noisy, 6))
    said = [watch.rising(step, 2.0 * 1.01**step) for step in range(66, 120)]
    fired = [i for i, s in enumerate(said) if s is not None]
    assert len(fired) == 1 and watch.warned  # once, after three rising block means
    lowest, last = said[fired[0]]  # type: ignore[misc]
    assert lowest < last and last >= (1 + rising.MARGIN) * lowest


def test_a_run_whose_loss_keeps_rising_warns_once_and_a_falling_one_never(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--train-iters", "60", "--lr-warmup-iters", "5", "--lr", "0.003")
    monkeypatch.setenv("FAULT_RISE", "6-60:0")
    _fit(None, *flags)
    said = [line for line in capsys.readouterr().err.splitlines() if "has risen" in line]
    assert len(said) == 1 and "--lr (this run: 0.003; try 0.0003)" in said[0], said
    monkeypatch.delenv("FAULT_RISE")
    _fit(None, *flags)
    assert "has risen" not in capsys.readouterr().err
