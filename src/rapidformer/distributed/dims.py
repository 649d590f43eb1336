"""Parallel degrees: how the world of ranks splits into data, tensor and pipeline axes."""

from __future__ import annotations

from dataclasses import dataclass

from rapidformer.config.schema import RapidformerConfig


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh axis; ``dp * tp * pp == world_size`` once validated."""

    world_size: int
    tp: int
    pp: int
    rank: int = 0

    @property
    def dp_rank(self) -> int:
        """This rank's index on the data-parallel axis (tp and pp vary fastest)."""
        return self.rank // (self.tp * self.pp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks left after tensor and pipeline parallelism."""
        return max(1, self.world_size // (self.tp * self.pp))

    @classmethod
    def from_config(cls, config: RapidformerConfig, world_size: int, rank: int = 0) -> ParallelDims:
        return cls(
            world_size=world_size,
            rank=rank,
            tp=config.parallel.tensor_model_parallel_size,
            pp=config.parallel.pipeline_model_parallel_size,
        )

    def global_batch_size(self, config: RapidformerConfig) -> int:
        """--global-batch-size, or micro x dp when it is not given."""
        given = config.data.global_batch_size
        return given if given is not None else config.data.micro_batch_size * self.dp

    def accumulation_steps(self, config: RapidformerConfig) -> int:
        """Micro-batches each rank runs per optimizer step: global / (micro x dp)."""
        return self.global_batch_size(config) // (config.data.micro_batch_size * self.dp)
