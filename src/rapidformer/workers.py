"""``rapidformer --nproc-per-node N [flags]``: the command on N local processes, one message on
error.

torchrun turns any worker's non-zero exit into its own ``ChildFailedError`` traceback (some 40
lines) and exits 1, whatever the worker reported. This runs torchrun's own agent in this process
(``torch.distributed.run``, standalone rendezvous on this machine) around ``python -m rapidformer
[flags]``, and:

* checks the flags once, for N ranks, before any worker starts: a bad combination is one
  message and exit 2, and no process is started;
* gives each worker its share of the cores (``OMP_NUM_THREADS``, unless set);
* when a worker fails, leaves with that worker's exit code and adds nothing: the worker said
  what went wrong (a configuration error on rank 0 only, :mod:`rapidformer.reporting`).

Several machines still start one ``torchrun`` per machine (docs/cli.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

LAUNCH_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def split_launch(args: Sequence[str]) -> tuple[int | None, list[str]]:
    """(the ``--nproc-per-node`` value, the other flags); None where it is not given."""
    rest: list[str] = []
    nproc: int | None = None
    items = iter(args)
    for arg in items:
        name, _, value = arg.partition("=")
        if name in LAUNCH_FLAGS:
            nproc = _count(value or next(items, ""))
        else:
            rest.append(arg)
    return nproc, rest


def _count(text: str) -> int:
    from rapidformer.errors import ConfigError

    if not text.isdigit() or int(text) < 1:
        raise ConfigError.single(
            "--nproc-per-node", text, "must be a number of processes, at least 1", "e.g. 2"
        )
    return int(text)


def run_local_workers(nproc: int, args: Sequence[str]) -> int:
    """Run ``python -m rapidformer args`` on ``nproc`` local processes; the exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "LOCAL_RANK" in os.environ:
        from rapidformer.errors import ConfigError

        raise ConfigError.single(
            "--nproc-per-node",
            nproc,
            "this process is already one worker of a launched job (torchrun set LOCAL_RANK)",
            "drop --nproc-per-node under torchrun, or run rapidformer --nproc-per-node alone",
        )
    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    # The agent's own records (rendezvous, "failed (exitcode: 2)") repeat what the workers
    # said; its errors are left to the exit code.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    launch = torchrun.parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "rapidformer", *args]
    )
    try:
        torchrun.run(launch)
    except ChildFailedError as failed:
        # The first worker that exited with a code of its own; the agent stops the others
        # with a signal (a negative code) once one failed.
        own = [f for f in failed.failures.values() if f.exitcode > 0]
        first = min(own or failed.failures.values(), key=lambda failure: failure.timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    return 0
