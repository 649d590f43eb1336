"""A distributed sampler that hands every layout the same micro-batches, and resumes mid-epoch.

Each epoch draws one permutation of the dataset from ``seed + epoch`` (identical on every rank).
The permutation is read as a stream of micro-batches, ``dp`` of them at a time, and
data-parallel rank r takes the r-th of each group of ``dp`` (Megatron's contiguous slices
``[r*mbs, (r+1)*mbs)`` of every ``mbs x dp`` chunk). So micro-step k of rank r holds exactly the
samples of micro-step ``k*dp + r`` of one process: not only does global step k consume the
permutation's entries [k*G, (k+1)*G) for a global batch G, every micro-batch is the same set
of samples on every layout, and per-micro-batch statistics (MoE's balancing loss, routing
figures) do not depend on the rank count.

The epoch's last, incomplete chunk is cut into ``dp`` equal contiguous parts (each rank its
last, shorter micro-batch); the fewer than ``dp`` samples left over are not used this epoch
(every rank must run the same number of steps, or the last all-reduce hangs).

Resuming needs only ``(epoch, consumed)``: the permutation is recomputed, and the sampler starts
after the samples this rank already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


def contiguous_share(
    order: Sequence[int], micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[int]:
    """Rank ``dp_rank``'s samples of an epoch's global ``order`` (see the module docstring)."""
    chunk = micro_batch_size * dp_size
    full = len(order) // chunk * chunk
    mine: list[int] = []
    for start in range(dp_rank * micro_batch_size, full, chunk):
        mine.extend(order[start : start + micro_batch_size])
    tail = len(order[full:]) // dp_size
    mine.extend(order[full + dp_rank * tail : full + (dp_rank + 1) * tail])
    return mine


class ResumableDistributedSampler(Sampler[int]):
    def __init__(
        self,
        num_samples: int,
        *,
        micro_batch_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        """The loader's batch size: the unit a rank takes of each chunk."""
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, consumed_samples: int) -> None:
        """Start ``epoch`` after this rank's first ``consumed_samples`` samples."""
        self.epoch = epoch
        self.start = consumed_samples

    def _epoch_order(self) -> list[int]:
        """The whole epoch's order, the same on every rank."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def _rank_indices(self) -> list[int]:
        return contiguous_share(
            self._epoch_order(), self.micro_batch_size, self.dp_rank, self.dp_size
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_indices()[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples // self.dp_size - self.start)
