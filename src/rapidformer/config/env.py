"""The only place that reads the launcher's environment (torchrun sets these variables)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rapidformer.errors import Violation

RENDEZVOUS = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What every rank of a job of several needs besides WORLD_SIZE to find the others (torchrun,
mp.spawn via rapidformer.launcher, Slurm scripts set them)."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher (torchrun, mp.spawn) described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None = 1
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE, else Open MPI's
    or Slurm's count); None where a job of several processes does not say."""
    omp_num_threads: int | None = None
    """The OMP_NUM_THREADS the process was started with (None: not set)."""
    restart_count: int | None = None
    """torchrun's attempt number (0 at first, +1 per restart); None outside torchrun."""
    agent_store: tuple[str, int] | None = None
    """Where torchrun's agent hosts the job's store (MASTER_ADDR, MASTER_PORT), when the
    workers use it; None otherwise."""

    @classmethod
    def read(cls) -> LaunchEnv:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_world_size=_local_world_size(int(os.environ.get("WORLD_SIZE", "1"))),
            omp_num_threads=_int_or_none(os.environ.get("OMP_NUM_THREADS")),
            restart_count=int(restarts) if restarts is not None else None,
            agent_store=(
                (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) if agent else None
            ),
        )


def launch_violations(env: LaunchEnv) -> list[Violation]:
    """A WORLD_SIZE of several without the rest of a launcher's variables: this process could
    only wait out the timeout for peers nobody started, so it is refused before it waits."""
    joined = _joined_size()
    if env.world_size == 1 or joined == env.world_size:
        return []
    missing = [name for name in RENDEZVOUS if name not in os.environ]
    fix = (
        f"launch every rank with torchrun --nproc-per-node {env.world_size} (it sets them), "
        "or unset WORLD_SIZE to train in one process"
    )
    if missing:
        rule = (
            f"this process is one of {env.world_size}, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so it cannot find the others"
        )
        return [Violation("WORLD_SIZE", env.world_size, rule, fix)]
    if joined is not None:  # a group an earlier run in this process left (e.g. one of 1)
        rule = f"this process already belongs to a process group of {joined}, not {env.world_size}"
        return [Violation("WORLD_SIZE", env.world_size, rule, "start the job in a new process")]
    if not 0 <= env.rank < env.world_size:
        rule = f"RANK={env.rank} is not one of the {env.world_size} ranks 0..{env.world_size - 1}"
        return [Violation("WORLD_SIZE", env.world_size, rule, fix)]
    return []


def _joined_size() -> int | None:
    """The size of the process group this process already belongs to (None: none). One it
    joined itself (``init_method="tcp://..."``) found the others without these variables."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def _local_world_size(world_size: int) -> int | None:
    own = _int_or_none(os.environ.get("LOCAL_WORLD_SIZE"))
    if own is not None or world_size == 1:  # one process: alone, whatever the allocation
        return own or 1
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        # Slurm writes "4(x2)" for 4 tasks on each of 2 nodes.
        count = _int_or_none(os.environ.get(name, "").split("(")[0])
        if count is not None:
            return count
    return None


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None
