"""CPU threads per rank: the machine's cores shared by the job's processes on it.

torch starts each process with a thread per core. Several ranks on one machine then run several
threads per core between them, and on a CPU machine every matrix product waits for the others.
The engine gives each rank torch's count divided by the local ranks, unless the choice was made
already: ``OMP_NUM_THREADS`` in the environment (torchrun sets 1 per worker; ``rapidformer
--nproc-per-node`` sets the cores' share), or the program's own ``torch.set_num_threads``. The
run's plan says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rapidformer.config.env import LaunchEnv


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str

    def __str__(self) -> str:
        return f"{self.threads} CPU thread{'s' * (self.threads != 1)} per rank ({self.why})"


def cores() -> int:
    """The cores this process may run on (hardware threads, as the OS counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> int | None:
    """The physical cores among :func:`cores` (two hardware threads of one core count once),
    where Linux says; None elsewhere."""
    try:
        cpus = os.sched_getaffinity(0)
        topology = Path("/sys/devices/system/cpu")
        return len(
            {
                tuple((topology / f"cpu{cpu}/topology" / name).read_text().strip()
                      for name in ("physical_package_id", "core_id"))
                for cpu in cpus
            }
        )  # fmt: skip
    except (AttributeError, OSError):
        return None


def choose_threads(env: LaunchEnv) -> ThreadChoice:
    """Set this process's intra-op threads where nothing chose them (see the module
    docstring); returns what it runs with and why."""
    now = torch.get_num_threads()
    if env.omp_num_threads is not None:
        return ThreadChoice(now, "OMP_NUM_THREADS")
    # torch starts with a thread per core: per hardware thread or per physical core,
    # depending on its build. Any other count was the program's choice.
    if now not in (cores(), physical_cores()):
        return ThreadChoice(now, "set by the program: torch.set_num_threads")
    ranks = env.local_world_size
    if ranks is None:
        return ThreadChoice(
            now,
            "torch's default: the launcher did not say how many ranks share this machine "
            "(no LOCAL_WORLD_SIZE); set OMP_NUM_THREADS",
        )
    share = max(1, now // max(1, ranks))
    if share != now:
        torch.set_num_threads(share)
    return ThreadChoice(
        share,
        f"{now} cores / {ranks} rank{'s' * (ranks != 1)} on this machine; "
        "OMP_NUM_THREADS overrides",
    )
