"""2-rank gloo DDP equals the single-process run on the same global batches, launched by
torchrun through the black-box CLI (iteration-based) and by a spawn launcher (epoch-based,
with a shorter last step per epoch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidformer.testing import run_distributed
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses, tiny_trainer

TOLERANCE = 1e-5


def _max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[step] - b[step]) for step in a)


@pytest.mark.distributed
def test_two_rank_ddp_under_torchrun_matches_single_process(tmp_path: Path) -> None:
    # Single process: micro 8, no accumulation. Two ranks: micro 2 x accumulation 2 each.
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_flags = ["--train-iters", "10", "--global-batch-size", "8", "--eval-interval", "5"]
    tiny_trainer(*run_flags, "--micro-batch-size", "8", "--save", str(single)).fit()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *("-m", "rapidformer", "--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS),
        *(*run_flags, "--micro-batch-size", "2", "--save", str(ddp)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = "data parallel: torch DistributedDataParallel (2 ranks, gloo, gradients as views of"
    assert plan in run.stderr
    assert "accumulation 2 = global batch 8" in run.stderr

    reference, distributed = read_losses(single), read_losses(ddp)
    assert sorted(distributed) == list(range(1, 11))
    assert _max_diff(reference, distributed) <= TOLERANCE
    assert reference[10] < reference[1] - 0.3  # it trained
    # Every validation sample is scored once over the two ranks: same eval loss.
    assert _max_diff(read_losses(single, "eval"), read_losses(ddp, "eval")) <= TOLERANCE


EPOCH_FLAGS = ("--epochs", "2", "--global-batch-size", "12")


def _epoch_run(save: str) -> None:
    torch.set_num_threads(1)
    tiny_trainer(*EPOCH_FLAGS, "--micro-batch-size", "2", "--save", save).fit()


@pytest.mark.distributed
def test_two_rank_epoch_training_with_a_short_last_step_matches_single_process(
    tmp_path: Path,
) -> None:
    # 64 samples, global batch 12: five full steps and one of 4 samples per epoch. On two
    # ranks the short step is one micro-batch instead of three: DDP must still all-reduce it.
    single = tmp_path / "single"
    tiny_trainer(*EPOCH_FLAGS, "--micro-batch-size", "4", "--save", str(single)).fit()
    run_distributed(_epoch_run, 2, str(tmp_path / "ddp"))
    reference, distributed = read_losses(single), read_losses(tmp_path / "ddp")
    assert sorted(reference) == list(range(1, 13))
    assert _max_diff(reference, distributed) <= TOLERANCE
