"""A 2-rank gloo DDP run, launched by torchrun through the black-box CLI, equals the
single-process run on the same global batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses, tiny_trainer

STEPS = 10
TOLERANCE = 1e-5


@pytest.mark.distributed
def test_two_rank_ddp_under_torchrun_matches_single_process(tmp_path: Path) -> None:
    # Single process: micro 8, no accumulation. Two ranks: micro 2 x accumulation 2 each.
    single = tmp_path / "single"
    tiny_trainer(
        "--train-iters",
        str(STEPS),
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "8",
        "--eval-interval",
        "5",
        "--save",
        str(single),
    ).fit()
    ddp = tmp_path / "ddp"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "rapidformer",
        "--user-script",
        str(DETERMINISTIC_SCRIPT),
        *TINY_FLAGS,
        "--train-iters",
        str(STEPS),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--eval-interval",
        "5",
        "--save",
        str(ddp),
    ]
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data parallel: torch DistributedDataParallel (2 ranks, gloo)" in run.stderr
    assert "accumulation 2 = global batch 8" in run.stderr

    reference, distributed = read_losses(single), read_losses(ddp)
    assert sorted(distributed) == list(range(1, STEPS + 1))
    assert max(abs(reference[s] - distributed[s]) for s in reference) <= TOLERANCE
    # Every validation sample is scored once over the two ranks: same eval loss.
    ref_eval, ddp_eval = read_losses(single, "eval"), read_losses(ddp, "eval")
    assert ref_eval.keys() == ddp_eval.keys() == {5, 10}
    assert max(abs(ref_eval[s] - ddp_eval[s]) for s in ref_eval) <= TOLERANCE
    assert reference[STEPS] < reference[1]  # it trained
