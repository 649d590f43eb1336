"""The dynamic-shape data iterator: batches of similar length, padded to a few bucket lengths.

Padding every batch to ``--seq-length`` wastes compute on pad tokens when lengths vary;
padding to each batch's own longest sample gives as many shapes as batches, which defeats
compilers and allocator caches. The middle way: a small fixed set of bucket lengths (multiples
of 8, geometric from 8 to ``seq_length / 8``, then every ``seq_length / 8``: 11 shapes for 512),
and samples grouped by length so that a batch's samples fall into one bucket.

Grouping happens inside windows of ``micro_batch x 64`` consecutive samples of the epoch's
shuffled order: a window is sorted by length, cut into micro-batches, and those are put back in
a seeded random order; then the data-parallel ranks take their micro-batches of that order as
:mod:`rapidformer.data.samplers` says, so every layout reads the same micro-batches. The result
is deterministic and keeps the resumable sampler's contract (a rank's position is still
"micro-batches consumed in this epoch"). A batch holds the same
samples whatever the padding, so its loss equals the fixed-shape loss of those samples.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rapidformer.data.samplers import ResumableDistributedSampler

WINDOW_MICRO_BATCHES = 64


def bucket_lengths(seq_length: int) -> list[int]:
    """The padded lengths batches may have; the last is ``seq_length`` itself."""
    step = max(8, -(-seq_length // 8 // 8) * 8)  # ~seq_length / 8, a multiple of 8
    buckets = {seq_length}
    length = 8
    while length < step:
        buckets.add(length)
        length *= 2
    buckets.update(range(step, seq_length, step))
    return sorted(b for b in buckets if b <= seq_length)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    return buckets[min(bisect.bisect_left(buckets, length), len(buckets) - 1)]


class LengthGroupedSampler(ResumableDistributedSampler):
    """A :class:`ResumableDistributedSampler` whose epoch order groups similar lengths into
    consecutive micro-batches (see the module docstring). The grouping is done on the whole
    epoch's order, before the ranks take their shares, so every layout gets the same
    micro-batches (and the same bucket lengths) as one process."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        micro_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            len(lengths),
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=shuffle,
            seed=seed,
        )
        self.lengths = np.asarray(lengths)

    def _epoch_order(self) -> list[int]:
        order = np.asarray(super()._epoch_order(), dtype=np.int64)
        rng = np.random.RandomState((self.seed + 7919 * self.epoch) % 2**32)
        window = self.micro_batch_size * WINDOW_MICRO_BATCHES
        grouped: list[int] = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches = [
                chunk[i : i + self.micro_batch_size]
                for i in range(0, len(chunk), self.micro_batch_size)
            ]
            # The short tail batch stays last so that only the epoch's end has a small batch.
            full = [b for b in batches if len(b) == self.micro_batch_size]
            tail = [b for b in batches if len(b) < self.micro_batch_size]
            for index in rng.permutation(len(full)):
                grouped.extend(full[index].tolist())
            for batch in tail:
                grouped.extend(batch.tolist())
        return grouped


class BucketCollate:
    """Wraps a collate function that accepts ``pad_to=``: pads each batch to its bucket."""

    def __init__(self, collate_fn: Callable[..., Any], buckets: Sequence[int]) -> None:
        self.collate_fn = collate_fn
        self.buckets = list(buckets)
        self.shapes_seen: set[int] = set()

    def __call__(self, samples: list[Any]) -> Any:
        longest = max(_sample_length(s) for s in samples)
        pad_to = bucket_for(longest, self.buckets)
        self.shapes_seen.add(pad_to)
        return self.collate_fn(samples, pad_to=pad_to)


def accepts_pad_to(collate_fn: Callable[..., Any] | None) -> bool:
    if collate_fn is None:
        return False
    try:
        return "pad_to" in inspect.signature(collate_fn).parameters
    except (TypeError, ValueError):
        return False


def _sample_length(sample: Any) -> int:
    ids = sample["input_ids"] if isinstance(sample, dict) else sample
    return len(ids) if not isinstance(ids, torch.Tensor) else int(ids.shape[0])
