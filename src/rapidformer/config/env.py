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

    @classmethod
    def read(cls) -> LaunchEnv:
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
