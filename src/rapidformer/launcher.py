"""Run a function on several local processes from one Python process: data parallelism and
ZeRO from a notebook, where there is no ``torchrun``.

``launch(train, num_processes=2)`` forks the processes (a notebook's functions cannot be
pickled for a fresh interpreter, so fork is the only way they reach the workers), gives each the
variables torchrun would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), runs ``train(*args)`` in each, and returns rank 0's result. Inside, a
:class:`~rapidformer.engine.RapidformerEngine` or a template joins the process group as under
torchrun: gloo on CPUs, nccl on GPUs (one GPU per process).

CUDA must not be initialised in the calling process before a launch (a forked child cannot use
it); the launch refuses if it is.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["launch"]

_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    num_processes: int | None = None,
    master_port: int | None = None,
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` local processes (default: one per GPU;
    required on a CPU machine) and return what rank 0 returned. An exception in any process
    is raised here with that process's traceback."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if num_processes is None:
        if not torch.cuda.is_available():
            raise ValueError("launch(num_processes=N): on a machine without GPUs, say how many")
        num_processes = torch.cuda.device_count()
    if num_processes < 1:
        raise ValueError(f"launch(num_processes={num_processes}): need at least 1")
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            raise RuntimeError(
                "launch() after a one-process run that created a process group in this process "
                "(a DeepSpeed engine keeps its group of one for the rest of the process, or an "
                "engine was not closed): forked processes would inherit it. Restart the "
                "notebook's kernel and launch before running anything distributed in it"
            )
        raise RuntimeError(
            f"launch() inside a process group of {dist.get_world_size()} ranks: this process "
            "already runs distributed; call the function directly"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "launch(): CUDA is already initialised in this process, and forked processes "
            "cannot use it. Restart the notebook's kernel and launch before anything touches "
            "the GPU (move model creation into the launched function)"
        )
    port = master_port if master_port is not None else _free_port()
    with tempfile.TemporaryDirectory(prefix="rapidformer-launch-") as tmp:
        result_file = Path(tmp) / "rank0.pkl"
        mp.start_processes(
            _worker,
            args=(function, args, num_processes, port, str(result_file)),
            nprocs=num_processes,
            start_method="fork",
        )
        with result_file.open("rb") as handle:
            return pickle.load(handle)


def _worker(
    rank: int,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    port: int,
    result_file: str,
) -> None:
    saved = {key: os.environ.get(key) for key in _ENV_KEYS}
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        result = function(*args)
        if rank == 0:
            with open(result_file, "wb") as handle:
                pickle.dump(result, handle)
    finally:
        _close_process_group()
        for key, value in saved.items():  # a 1-process launch runs in a forked child too
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _close_process_group() -> None:
    """A function that returned without closing its engine leaves the group open; the
    process exits next, so it is destroyed here (quietly: peers may be gone already)."""
    import torch.distributed as dist

    from rapidformer.distributed.process_group import retire_groups

    if dist.is_available() and dist.is_initialized():
        retire_groups()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
