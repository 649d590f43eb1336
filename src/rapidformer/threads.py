"""CPU threads per rank: the machine's cores shared by the job's processes on it.

torch starts each process with a thread per core. Several ranks on one machine then run several
threads per core between them, and on a CPU machine every matrix product waits for the others
(measured here: a 2-core machine shared with other jobs ran a tiny model at 410-485 samples/s
with torch's default and at 792-1,481 with one thread). The engine gives each rank
``cores // local ranks`` threads, unless the choice was made already: ``OMP_NUM_THREADS`` in
the environment (torchrun sets 1 per worker; ``rapidformer --nproc-per-node`` sets the cores'
share), or the program's own ``torch.set_num_threads``. The run's plan says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rapidformer.config.env import LaunchEnv


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str

    def __str__(self) -> str:
        return f"{self.threads} CPU thread{'s' * (self.threads != 1)} per rank ({self.why})"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_threads(env: LaunchEnv) -> ThreadChoice:
    """Set this process's intra-op threads where nothing chose them (see the module
    docstring); returns what it runs with and why."""
    now, available = torch.get_num_threads(), cores()
    if env.omp_num_threads is not None:
        return ThreadChoice(now, "OMP_NUM_THREADS")
    if now != available:
        return ThreadChoice(now, "set by the program: torch.set_num_threads")
    share = max(1, available // max(1, env.local_world_size))
    if share != now:
        torch.set_num_threads(share)
    ranks = env.local_world_size
    return ThreadChoice(
        share,
        f"{available} cores / {ranks} rank{'s' * (ranks != 1)} on this machine; "
        "OMP_NUM_THREADS overrides",
    )
