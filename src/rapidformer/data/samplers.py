"""A distributed sampler that can resume in the middle of an epoch.

Each epoch draws one permutation of the dataset from ``seed + epoch`` (identical on every rank),
trims it to a multiple of the data-parallel size, and gives rank r the indices at positions
r, r + dp, r + 2 dp, ... Because of that striding, the samples of global step k are the
permutation's entries [k*G, (k+1)*G) for a global batch G whatever the data-parallel size and
micro-batch size, which is what makes a 2-rank run comparable to a single-process one.

Resuming needs only ``(epoch, consumed)``: the permutation is recomputed, and the sampler starts
after the samples this rank already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    def __init__(
        self,
        num_samples: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.num_samples = num_samples
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

    def _rank_indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        # Every rank must run the same number of steps, or the last all-reduce hangs.
        usable = len(order) - len(order) % self.dp_size
        return order[self.dp_rank : usable : self.dp_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_indices()[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples // self.dp_size - self.start)
