"""Data for data parallelism: each rank reads its own, resumable share of every epoch, in the
micro-batches one process would read (micro-step k of rank r = one process's micro-step
``k*dp + r``; see :mod:`rapidformer.data.samplers`).

A user's DataLoader is rebuilt around :class:`ResumableDistributedSampler` with the same
dataset, batch size, collate function and workers. Shuffling is kept if the user's loader
shuffled. With ``--data-iterator dynamic-shape`` the sampler groups similar lengths and the
collate function pads to a few bucket lengths (see :mod:`rapidformer.data.dynamic_shape`).
Evaluation loaders are sharded without shuffling and without trimming, so that every validation
sample is scored exactly once over all ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.dynamic_shape import (
    BucketCollate,
    LengthGroupedSampler,
    accepts_pad_to,
    bucket_lengths,
)
from rapidformer.data.samplers import ResumableDistributedSampler
from rapidformer.distributed.dims import ParallelDims
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError
from rapidformer.state import PlanStep, TrainState


class EvalShardSampler(ResumableDistributedSampler):
    """Rank-strided, in order, nothing trimmed: ranks may get one sample more or less."""

    def _rank_indices(self) -> list[int]:
        return list(range(self.num_samples))[self.dp_rank :: self.dp_size]

    def __len__(self) -> int:
        return len(self._rank_indices())


def rebuild_loader(
    loader: DataLoader, sampler: ResumableDistributedSampler, collate_fn: Any = None
) -> DataLoader:
    """The same loader, reading through ``sampler`` (and ``collate_fn`` when given)."""
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "collate_fn": collate_fn or loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        # Its own generator: creating an iterator then draws worker seeds from it, not from
        # the global RNG, so a resumed run's dropout masks match the uninterrupted run's.
        "generator": torch.Generator().manual_seed(sampler.seed),
    }
    if loader.num_workers > 0:
        kwargs["persistent_workers"] = loader.persistent_workers
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)


def apply_data(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    dims = mesh.dims
    train = state.train_dataloader
    shape = _fixed_shape(train)
    if train is not None and not isinstance(train.sampler, ResumableDistributedSampler):
        if train.batch_size is None:
            raise ValueError("compose() needs a DataLoader with a batch_size (not a batch_sampler)")
        shuffle = isinstance(train.sampler, RandomSampler)
        sampler, collate_fn, shape = _train_order(train, config, dims, shuffle)
        state.train_dataloader = rebuild_loader(train, sampler, collate_fn)
    evaluation = state.eval_dataloader
    # Rebuilt even on one rank: the rebuilt loader has its own generator, so an evaluation no
    # longer draws from the global RNG and training randomness does not depend on when it runs.
    if evaluation is not None and not isinstance(evaluation.sampler, EvalShardSampler):
        sampler = EvalShardSampler(
            len(evaluation.dataset),  # type: ignore[arg-type]
            dp_rank=dims.dp_rank,
            dp_size=dims.dp,
            shuffle=False,
        )
        state.eval_dataloader = rebuild_loader(evaluation, sampler)
    if train is not None:
        micro, global_ = config.data.micro_batch_size, config.data.global_batch_size
        accumulation = dims.accumulation_steps(micro, global_)
        state.plan.append(
            PlanStep(
                "data",
                "resumable distributed sampler",
                f"micro batch {micro} x dp {dims.dp} x accumulation {accumulation} = global "
                f"batch {dims.global_batch_size(micro, global_)}; {shape}",
            )
        )
    return state


def _fixed_shape(train: DataLoader | None) -> str:
    """The plan's words for batches of one shape: a collate function may say what it makes
    (packed rows), else it pads."""
    said = getattr(train.collate_fn, "shape", None) if train is not None else None
    return (
        f"fixed shape: {said}"
        if isinstance(said, str)
        else ("fixed shape (as the collate function pads)")
    )


def _train_order(
    train: DataLoader, config: RapidformerConfig, dims: ParallelDims, shuffle: bool
) -> tuple[ResumableDistributedSampler, Any, str]:
    """The training sampler and collate function for the chosen --data-iterator, and a line
    for the plan saying what it does."""
    common: dict[str, Any] = {
        "dp_rank": dims.dp_rank, "dp_size": dims.dp, "shuffle": shuffle,
        "seed": config.training.seed,
    }  # fmt: skip
    micro = train.batch_size or 1
    fixed = ResumableDistributedSampler(
        len(train.dataset),  # type: ignore[arg-type]
        micro_batch_size=micro,
        **common,
    )
    if config.data.data_iterator == "fixed-shape":
        return fixed, None, _fixed_shape(train)
    lengths = getattr(train.dataset, "lengths", None)
    if lengths is None or not accepts_pad_to(train.collate_fn):
        raise ConfigError.single(
            "--data-iterator", "dynamic-shape",
            "needs a training dataset with a `lengths` attribute (tokens per sample) and a "
            "collate function that takes a `pad_to` keyword",
            "provide both from build_data() (rapidformer's templates do), or use fixed-shape",
        )  # fmt: skip
    lengths = np.asarray(lengths)
    if lengths.min() == lengths.max():
        return (
            fixed,
            None,
            (
                f"fixed shape: dynamic-shape requested, but every sample has {lengths[0]} tokens, "
                "so there is no padding to save; falling back"
            ),
        )
    seq_length = config.model.seq_length or int(lengths.max())
    buckets = bucket_lengths(seq_length)
    sampler = LengthGroupedSampler(lengths, micro, **common)
    shape = f"dynamic shape: length-grouped batches padded to {len(buckets)} buckets {buckets}"
    return sampler, BucketCollate(train.collate_fn, buckets), shape
