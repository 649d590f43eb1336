"""Data for data parallelism: each rank reads its own, resumable share of every epoch.

A user's DataLoader is rebuilt around :class:`ResumableDistributedSampler` with the same
dataset, batch size, collate function and workers. Shuffling is kept if the user's loader
shuffled. Evaluation loaders are sharded without shuffling and without trimming, so that every
validation sample is scored exactly once over all ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from rapidformer.config.schema import RapidformerConfig
from rapidformer.data.samplers import ResumableDistributedSampler
from rapidformer.distributed.dims import ParallelDims
from rapidformer.engine.state import PlanStep, TrainState


class EvalShardSampler(ResumableDistributedSampler):
    """Rank-strided, in order, nothing trimmed: ranks may get one sample more or less."""

    def _rank_indices(self) -> list[int]:
        return list(range(self.num_samples))[self.dp_rank :: self.dp_size]

    def __len__(self) -> int:
        return len(self._rank_indices())


def rebuild_loader(loader: DataLoader, sampler: ResumableDistributedSampler) -> DataLoader:
    """The same loader, reading through ``sampler``."""
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "collate_fn": loader.collate_fn,
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


def apply_data(state: TrainState, config: RapidformerConfig, dims: ParallelDims) -> TrainState:
    train = state.train_dataloader
    if train is not None and not isinstance(train.sampler, ResumableDistributedSampler):
        if train.batch_size is None:
            raise ValueError("compose() needs a DataLoader with a batch_size (not a batch_sampler)")
        sampler = ResumableDistributedSampler(
            len(train.dataset),  # type: ignore[arg-type]
            dp_rank=dims.dp_rank,
            dp_size=dims.dp,
            shuffle=isinstance(train.sampler, RandomSampler),
            seed=config.training.seed,
        )
        state.train_dataloader = rebuild_loader(train, sampler)
    evaluation = state.eval_dataloader
    if (
        evaluation is not None
        and dims.dp > 1
        and not isinstance(evaluation.sampler, EvalShardSampler)
    ):
        sampler = EvalShardSampler(
            len(evaluation.dataset),  # type: ignore[arg-type]
            dp_rank=dims.dp_rank,
            dp_size=dims.dp,
            shuffle=False,
        )
        state.eval_dataloader = rebuild_loader(evaluation, sampler)
    if train is not None:
        accumulation = dims.accumulation_steps(config)
        state.plan.append(
            PlanStep(
                "data",
                "resumable distributed sampler",
                f"micro batch {config.data.micro_batch_size} x dp {dims.dp} x accumulation "
                f"{accumulation} = global batch {dims.global_batch_size(config)}; fixed shape",
            )
        )
    return state
