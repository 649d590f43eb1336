"""Faults in two-rank torchrun jobs: a stop signal on one rank stops both at the same step
with a checkpoint; a NaN on rank 1 only makes both skip; a rank killed under --max-restarts
restarts the job from its checkpoint; without restarts, the survivor names the missing rank
within the configured timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.trainers import ROOT, TINY_FLAGS, read_losses

pytestmark = pytest.mark.distributed

FAULTY = ROOT / "tests" / "scripts" / "faulty_trainer.py"
RUN = ("--train-iters", "10", "--micro-batch-size", "4", "--global-batch-size", "8")


def _torchrun(
    save: Path, *flags: str, restarts: int = 0, timeout: int = 300, **faults: str
) -> subprocess.CompletedProcess[str]:
    command, env = _command(save, *flags, restarts=restarts, **faults)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def _command(
    save: Path, *flags: str, restarts: int = 0, **faults: str
) -> tuple[list[str], dict[str, str]]:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", str(restarts), "-m", "rapidformer", "--user-script", str(FAULTY)),
        *TINY_FLAGS,
        *RUN,
        *("--save", str(save), *flags),
    ]
    return command, {**os.environ, "OMP_NUM_THREADS": "1", **faults}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("two_ranks")
    run = _torchrun(save)
    assert run.returncode == 0, run.stderr[-3000:]
    return save


def _continues(uninterrupted: Path, resumed: Path, after: int) -> None:
    full, again = read_losses(uninterrupted), read_losses(resumed)
    for step in range(after + 1, 11):
        assert abs(again[step] - full[step]) <= 1e-5, (step, again[step], full[step])


def test_sigterm_on_rank_1_stops_both_ranks_at_one_step_and_the_rerun_continues(
    uninterrupted: Path, tmp_path: Path
) -> None:
    run = _torchrun(tmp_path, FAULT_SIGNAL="4:1:SIGTERM")
    assert run.returncode != 0
    # Both ranks stop at the same step (torchrun's summary shows the first worker's code): the
    # step after the signal, whose agreement is read without waiting for the device.
    assert run.stderr.count("stopped at step 5 of 10 by a stop signal") == 2, run.stderr[-3000:]
    assert "exitcode: 75" in run.stderr
    assert (tmp_path / "latest").read_text().strip() == "iter_0000005"
    resumed = _torchrun(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _continues(uninterrupted, tmp_path, after=5)


def test_sigterm_to_torchrun_itself_reaches_every_worker_and_they_save(tmp_path: Path) -> None:
    # What a cluster does on preemption: SIGTERM to the launcher, which forwards it.
    command, env = _command(tmp_path, "--train-iters", "100000")
    agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline and agent.poll() is None
        time.sleep(0.05)
    agent.send_signal(signal.SIGTERM)
    _, stderr = agent.communicate(timeout=120)
    assert stderr.count("by a stop signal (SIGTERM)") == 2, stderr[-3000:]
    step = int((tmp_path / "latest").read_text().strip()[len("iter_") :])
    assert f"stopped at step {step} of 100000" in stderr  # the same step on both ranks


def _digests(directory: Path, rank: int) -> dict[int, str]:
    rows = (directory / f"rank_{rank}.jsonl").read_text().splitlines()
    return {row["step"]: row["digest"] for row in map(json.loads, rows)}


@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_a_nan_on_rank_1_only_makes_both_ranks_skip(layout: str, tmp_path: Path) -> None:
    flags = ["--zero-3-memory-optimization"] if layout == "zero3" else []
    run = _torchrun(tmp_path / "run", *flags, FAULT_NAN="3:1", FAULT_DIGESTS=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 3 skipped: non-finite loss on rank 1" in run.stderr
    zero, one = _digests(tmp_path, 0), _digests(tmp_path, 1)
    for digests in (zero, one):  # each rank's parameters (its shards under ZeRO-3)
        assert digests[4] == digests[3] != digests[2]  # step 3 moved nothing
    if layout == "ddp":
        assert zero == one  # the replicas never diverged
    losses = read_losses(tmp_path / "run")
    assert all(loss == loss for step, loss in losses.items() if step != 3)  # finite after
    if layout == "zero3":
        return

    limited = _torchrun(tmp_path / "limit", "--max-skipped-steps", "3", FAULT_NAN="2-10:1")
    assert "exitcode: 3)" in limited.stderr, limited.stderr[-3000:]
    assert "3 consecutive steps skipped, the last at step 4" in limited.stderr


def test_a_killed_rank_restarts_the_job_from_its_checkpoint(
    uninterrupted: Path, tmp_path: Path
) -> None:
    run = _torchrun(tmp_path, "--save-interval", "2", restarts=1, FAULT_KILL="5:1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stderr and "iter_0000004" in run.stderr
    _continues(uninterrupted, tmp_path, after=4)
    assert abs(read_losses(tmp_path)[10] - read_losses(uninterrupted)[10]) <= 1e-5


@pytest.mark.parametrize("fault", ["FAULT_KILL", "FAULT_STALL"])
def test_without_restarts_the_survivor_names_the_missing_rank_within_the_timeout(
    fault: str, tmp_path: Path
) -> None:
    timeout_minutes = 0.1  # 6 s
    start = time.monotonic()
    run = _torchrun(
        tmp_path, "--distributed-timeout-minutes", str(timeout_minutes), **{fault: "3:1"}
    )
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "a collective failed on rank 0 (missing: rank 1)" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr.split("a collective failed")[0][-2000:]
    # Start-up and three steps take a few seconds; the failure itself must come within the
    # timeout (plus its quarter for the roll call), never after waiting without end.
    assert elapsed < 60, elapsed
