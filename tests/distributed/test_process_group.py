"""Leaving a process group: the group's last reference drops through Python, never inside a
DDP model's Reducer (see rapidformer.distributed.process_group.retire_groups for the hang
this prevents: with torch 2.13 and gloo, test_host_syncs' ZeRO-1 case hung in about one run
of five on two busy cores)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rapidformer.distributed import process_group
from rapidformer.testing.launch import run_distributed


def _gloo_workers() -> int:
    tasks = Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())


def _leave_then_free(out: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0])  # as the mesh's dp group: DDP's Reducer holds it in C++
    model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    del group
    model(torch.ones(2, 4)).sum().backward()
    before = _gloo_workers()
    process_group.destroy_process_group()
    process_group.retire_groups()  # another engine closes: the live model's group stays
    assert _gloo_workers() == before
    del model  # the Reducer lets go of the group here...
    gc.collect()
    kept = _gloo_workers()
    process_group.retire_groups()  # ...and the group is freed here, through Python
    gc.collect()
    after = _gloo_workers()
    Path(out, "workers.json").write_text(json.dumps([before, kept, after]))


def test_a_left_group_outlives_the_ddp_model_that_used_it(tmp_path: Path) -> None:
    run_distributed(_leave_then_free, 1, str(tmp_path))
    before, kept, after = json.loads((tmp_path / "workers.json").read_text())
    # (the default group's own workers outlive it in torch 2.13: not what this checks)
    assert kept == before and after < kept, (before, kept, after)


def _leave_at_different_speeds(out: str) -> None:
    process_group.ensure_process_group(torch.device("cpu"))
    rank = dist.get_rank()
    real = dist.destroy_process_group

    def slow_to_tear_down() -> None:
        real()
        time.sleep(1.0)  # rank 1 is still tearing its group down
        Path(out, "rank1_down").write_text(repr(time.time()))

    with mock.patch.object(dist, "destroy_process_group", slow_to_tear_down if rank else real):
        process_group.destroy_process_group()
    Path(out, f"rank{rank}_goes_on").write_text(repr(time.time()))


def test_no_rank_goes_on_before_every_rank_has_torn_its_group_down(tmp_path: Path) -> None:
    """A rank whose process exited while another was still tearing down aborted that one
    (exit -6, "terminate called without an active exception") after a finished run."""
    run_distributed(_leave_at_different_speeds, 2, str(tmp_path))
    down = float((tmp_path / "rank1_down").read_text())
    assert float((tmp_path / "rank0_goes_on").read_text()) >= down
