"""Parallel degrees: how the world of ranks splits into pipeline, data and tensor axes.

A leaf: plain integers in, nothing imported from the config. The layout is the one the device
mesh uses (:mod:`rapidformer.distributed.mesh`): pipeline outermost, tensor innermost, so the
ranks of one tensor-parallel group are neighbours (on one node), and the expert axis is a view
inside the data-parallel axis::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh axis; ``dp * tp * pp == world_size`` once validated (see
    :meth:`problems`)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel degree: a sub-axis of dp (it must divide dp)."""
    rank: int = 0

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks left after tensor and pipeline parallelism."""
        return max(1, self.world_size // (self.tp * self.pp))

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's index on the data-parallel axis: ranks that differ only in their tensor
        or pipeline position read the same samples."""
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def axes(self) -> dict[str, int]:
        """Every axis and its degree, for plans and checkpoint records."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep}

    def problems(self) -> list[str]:
        """What is wrong with these degrees (empty when they are consistent)."""
        found = [f"{name} must be at least 1" for name, d in self.axes.items() if d < 1]
        if found:
            return found
        if self.world_size % (self.tp * self.pp):
            found.append(
                f"tp {self.tp} x pp {self.pp} does not divide the world size {self.world_size}"
            )
        elif self.dp % self.ep:
            found.append(f"ep {self.ep} does not divide the data-parallel degree {self.dp}")
        return found

    def global_batch_size(self, micro_batch_size: int, global_batch_size: int | None) -> int:
        """The global batch, or micro x dp when it is not given."""
        return global_batch_size if global_batch_size is not None else micro_batch_size * self.dp

    def accumulation_steps(self, micro_batch_size: int, global_batch_size: int | None) -> int:
        """Micro-batches each rank runs per optimizer step: global / (micro x dp)."""
        global_ = self.global_batch_size(micro_batch_size, global_batch_size)
        return global_ // (micro_batch_size * self.dp)
