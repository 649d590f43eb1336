"""The only place that reads the launcher's environment (torchrun sets these variables)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher (torchrun, mp.spawn) described it."""

    rank: int
    local_rank: int
    world_size: int
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
            restart_count=int(restarts) if restarts is not None else None,
            agent_store=(
                (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) if agent else None
            ),
        )
