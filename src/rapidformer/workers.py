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
  what went wrong (a configuration error on rank 0 only, :mod:`rapidformer.fatal`); where
  every worker was killed by a signal, says which rank and signal;
* passes a stop signal (SIGTERM, SIGINT, SIGUSR1, ...) on to the workers and gives them time to
  save (:data:`SAVE_GRACE_S`): with ``--save`` the command exits 75, as one process does.

Several machines still start one ``torchrun`` per machine (docs/cli.md).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

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


SAVE_GRACE_S = 300
"""How long a stop signal leaves the workers to write their checkpoint and exit before the
agent kills them (torchrun's own default, 30 s, can cut a large checkpoint in half);
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` overrides."""

STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""The signals the agent passes on to the workers: torchrun's four and Slurm's SIGUSR1 (a
signal the agent does not handle would end it alone and leave its workers running)."""


def run_local_workers(nproc: int, args: Sequence[str], saves: bool) -> int:
    """Run ``python -m rapidformer args`` on ``nproc`` local processes; the exit code
    (``saves``: the run has ``--save``, so a stop signal makes it save and exit 75)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from rapidformer.errors import Preempted
    from rapidformer.reliability.signals import STOP_SIGNALS as SAVING_SIGNALS
    from rapidformer.threads import cores

    if "LOCAL_RANK" in os.environ:
        from rapidformer.errors import ConfigError

        raise ConfigError.single(
            "--nproc-per-node",
            nproc,
            "this process is already one worker of a launched job (torchrun set LOCAL_RANK)",
            "drop --nproc-per-node under torchrun, or run rapidformer --nproc-per-node alone",
        )
    grace = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SAVE_GRACE_S))
    # The agent's own records (rendezvous, "failed (exitcode: 2)") repeat what the workers
    # said; its errors are left to the exit code.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    launch = torchrun.parse_args(
        [
            *("--standalone", f"--nproc-per-node={nproc}", f"--shutdown-timeout={grace}"),
            *("--signals-to-handle", STOP_SIGNALS, "-m", "rapidformer", *args),
        ]
    )
    # The workers' share of the cores, for this run only (the caller's environment is kept).
    given = os.environ.get("OMP_NUM_THREADS")
    if given is None:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores() // nproc))
    try:
        torchrun.run(launch)
    except ChildFailedError as failed:
        return _first_failure(failed)
    except SignalException as stopped:
        # The agent passed the signal on and waited for the workers: with --save they wrote
        # their checkpoint, said so and exited 75, as one process does.
        if saves and stopped.sigval in SAVING_SIGNALS:
            return Preempted.exit_code
        print(f"rapidformer: stopped by {stopped.sigval.name}", file=sys.stderr)
        return 128 + int(stopped.sigval)
    finally:
        if given is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


def _first_failure(failed: ChildFailedError) -> int:
    """The exit code of the first worker that exited with a code of its own (the agent stops
    the others with a signal once one failed). Where every worker was killed by a signal (the
    kernel's out-of-memory killer, a user's kill), none said anything: say which."""
    own = [f for f in failed.failures.values() if f.exitcode > 0]
    if own:
        return min(own, key=lambda failure: failure.timestamp).exitcode
    rank, first = min(failed.failures.items(), key=lambda item: item[1].timestamp)
    print(
        f"rapidformer: error: worker rank {rank} was killed by {first.signal_name()} "
        "(out of memory, or a kill from outside?)",
        file=sys.stderr,
    )
    return 1
