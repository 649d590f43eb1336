"""Run a function on several CPU ranks the way torchrun would (RANK, WORLD_SIZE, MASTER_*)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rapidformer.distributed.process_group import retire_groups


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    finished: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)
    if dist.is_initialized():
        retire_groups()  # freed through Python, never inside a DDP model's destructor
        dist.destroy_process_group()
    # Rank 0 hosts the rendezvous store: if it exits while another rank is still tearing its
    # process group down, that rank's store client aborts the process ("terminate called
    # without an active exception"). Nobody leaves before everybody is done.
    finished.wait(timeout=300)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(*args)`` in ``world_size`` fresh processes joined by env:// rendezvous.

    ``fn`` must be importable (a module-level function) and should write its results to files;
    an exception on any rank is re-raised here.
    """
    finished = mp.get_context("spawn").Barrier(world_size)
    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), finished, fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
