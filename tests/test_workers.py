"""``rapidformer --nproc-per-node N``: a stop signal to the command saves and exits 75 as one
process does, and the same command resumes; workers killed by a signal are named; a dry run
plans the N ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rapidformer.cli import main
from tests.helpers.trainers import ROOT, TINY_FLAGS

FAULTY = ROOT / "tests" / "scripts" / "faulty_trainer.py"
RUN = ["--train-iters", "8", "--micro-batch-size", "4", "--global-batch-size", "8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(*flags: str, **faults: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "rapidformer", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, "--user-script", str(FAULTY), *TINY_FLAGS, *RUN, *flags],
        capture_output=True, text=True, timeout=300, env={**ENV, **faults},
    )  # fmt: skip


@pytest.mark.distributed
def test_a_stop_signal_to_the_command_saves_exits_75_and_the_command_resumes(
    tmp_path: Path,
) -> None:
    """SIGTERM reaches the launcher (as a scheduler sends it): the agent passes it on, the
    workers agree on a step, save there and exit 75, and so does the command."""
    save = tmp_path / "run"
    stopped = _launch("--save", str(save), FAULT_SIGNAL_LAUNCHER="3:0:SIGTERM")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "SignalException" not in stopped.stderr
    step = int((save / "latest").read_text().strip().removeprefix("iter_"))
    assert 3 <= step < 8
    resumed = _launch("--save", str(save))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (save / "latest").read_text().strip() == "iter_0000008"
    # Each step trained once: the first run's up to its checkpoint, the rest after it.
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))


@pytest.mark.distributed
def test_workers_killed_by_a_signal_are_named(tmp_path: Path) -> None:
    """Workers the kernel kills (SIGKILL: out of memory) say nothing themselves (where one
    rank survives, it names the lost peer and exits 4): the command names a rank and the
    signal, once, and exits 1."""
    killed = _launch(FAULT_KILL="2:0,1")
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert killed.stderr.count("rapidformer: error: worker rank") == 1, killed.stderr[-3000:]
    assert "was killed by SIG" in killed.stderr and "Traceback" not in killed.stderr


LATE_FIRST_RANK = """
import os, time
from rapidformer.errors import ConfigError
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(3)  # the first rank finds the error last
raise ConfigError.single("--seed", 7, "is refused by this script", "use another seed")
"""


@pytest.mark.distributed
def test_a_configuration_error_is_said_when_the_silent_rank_finds_it_first(
    tmp_path: Path,
) -> None:
    """Only the first rank says a configuration error; the others wait until it has, or the
    agent, seeing a silent rank exit first, stops the first one before it speaks (the CI saw
    exit 2 and no message)."""
    script = tmp_path / "late_first_rank.py"
    script.write_text(LATE_FIRST_RANK)
    command = [sys.executable, "-m", "rapidformer", "--nproc-per-node", "2"]
    ended = subprocess.run(
        [*command, "--user-script", str(script)],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ended.returncode == 2, ended.stderr[-3000:]
    assert ended.stderr.count("rapidformer: error: invalid rapidformer configuration") == 1
    assert "--seed=7: is refused by this script" in ended.stderr, ended.stderr[-3000:]


def test_a_dry_run_plans_the_ranks_of_nproc_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [
        *("--task", "pretraining", "--num-layers", "2", "--hidden-size", "64"),
        *("--num-attention-heads", "4", "--seq-length", "32", "--tokenizer-type"),
        *("GPT2BPETokenizer", "--vocab-file", "no/vocab.json", "--merge-file", "no/merges.txt"),
        *("--data-path", "no/corpus", "--micro-batch-size", "1", "--lr", "1e-4"),
        *("--train-iters", "10", "--tensor-model-parallel-size", "2", "--dry-run"),
    ]
    assert main(["--nproc-per-node", "4", *flags]) == 0
    assert "dp 2 x tp 2 x pp 1" in capsys.readouterr().out
    assert main(["--nproc-per-node", "4", *flags, "--dry-run-world-size", "2"]) == 0
    assert "dp 1 x tp 2 x pp 1" in capsys.readouterr().out  # the flag says it: kept
