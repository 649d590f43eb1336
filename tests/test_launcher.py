"""rapidformer.launch: several processes from inside one Python process (a notebook's way to
data parallelism). ZeRO-2 on 2 launched processes must reproduce the 1-process fp32 run."""

from __future__ import annotations

import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rapidformer
from tests.helpers.parity import PARITY, train_gpt


def _zero2_run(layout: dict[str, Any]) -> dict[str, Any]:
    result = train_gpt(layout, steps=10)
    return {**result, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}


def _fails_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 has bad data")


def _fresh(function: Callable[[], None]) -> None:
    """Run ``function`` in a fresh interpreter, as a notebook kernel is: this test process may
    hold the one-rank group an earlier in-process DeepSpeed test left (DeepSpeed keeps it for
    its caches), from which launch() rightly refuses to fork."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        pool.submit(function).result()  # re-raises the child's AssertionError


def _zero2_parity() -> None:
    torch.set_num_threads(1)
    reference = train_gpt({}, steps=10)  # this process, fp32, no process group
    launched = rapidformer.launch(
        _zero2_run, ({"zero_2_memory_optimization": True},), num_processes=2
    )
    assert (launched["rank"], launched["world"]) == (0, 2)  # rank 0's result comes back
    assert any("ZeRO-2" in step or "zero-2" in step.lower() for step in launched["plan"])
    gap = max(abs(a - b) for a, b in zip(reference["losses"], launched["losses"], strict=True))
    print(f"launch ZeRO-2 x2 vs 1 process: max loss gap {gap:.2e}; {launched['memory']}")
    assert gap <= PARITY, gap
    # Gradients and optimizer state are sharded: this rank's memory report says so.
    for held in ("gradients", "optimizer state"):
        assert re.search(held + r" [\d.]+ MiB \(0\.50x\)", launched["memory"]), launched["memory"]
    assert "RANK" not in os.environ or os.environ["RANK"] != "0"  # the caller's env is intact


def _errors_reach_the_caller() -> None:
    with pytest.raises(Exception, match="rank 1 has bad data"):
        rapidformer.launch(_fails_on_rank_1, num_processes=2)
    with pytest.raises(ValueError, match="num_processes=0"):
        rapidformer.launch(_fails_on_rank_1, num_processes=0)
    # A group of one left by an earlier run here (DeepSpeed keeps its own): refused, with why.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="Restart the notebook's kernel"):
        rapidformer.launch(_fails_on_rank_1, num_processes=2)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_zero2_on_two_launched_processes_matches_the_one_process_run() -> None:
    _fresh(_zero2_parity)


@pytest.mark.distributed
def test_an_error_in_one_launched_process_reaches_the_caller() -> None:
    _fresh(_errors_reach_the_caller)
