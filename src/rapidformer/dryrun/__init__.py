"""``--dry-run``: the plan and every rank's memory before anything is allocated.

The run's own flags are validated as for a real run, then each simulated rank composes the model
on the meta device over a fake process group (:mod:`rapidformer.dryrun.simulate`): the model
state is what the real run's memory report would count, the activations are one micro-batch run
on the meta device (:mod:`rapidformer.dryrun.activations`), and the buffers and pipeline
in-flight micro-batches follow (:mod:`rapidformer.dryrun.estimate`). Nothing is allocated, no
process group touches the network, no data file is opened. With a device size
(``--device-memory``, or the GPU's), the worst rank is checked against it and, when it does not
fit, the switches that would make it fit are tried in order (:mod:`rapidformer.dryrun.fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from rapidformer.config.fields import all_fields
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.dryrun.estimate import (
    RankMemory,
    StageProfile,
    Workload,
    gpt_workload,
    rank_memory,
)
from rapidformer.dryrun.fit import fits, ladder, parse_memory
from rapidformer.dryrun.report import DryRunReport, Suggestion
from rapidformer.dryrun.simulate import NOT_SIMULATED
from rapidformer.engine.validation import validate
from rapidformer.errors import ConfigError, Violation

__all__ = [
    "DryRunReport",
    "Suggestion",
    "Workload",
    "climb",
    "dry_run",
    "gpt_workload",
    "parse_memory",
    "simulated_ranks",
    "worst_rank",
]

ALL_RANKS_UP_TO = 64
"""Worlds up to this size simulate every rank; larger ones each pipeline position's first and
last data-parallel rank (tensor-parallel ranks hold equal shards)."""


def simulated_ranks(dims: ParallelDims, every_rank: bool) -> list[int]:
    """The ranks a dry run composes: all, or one per (pipeline position, first/last dp)."""
    if every_rank:
        return list(range(dims.world_size))
    ranks = {
        pp * dims.tp * dims.dp + dp * dims.tp for pp in range(dims.pp) for dp in (0, dims.dp - 1)
    }
    return sorted(ranks)


def dry_run(
    config: RapidformerConfig,
    world_size: int,
    work: Workload,
    model: str,
    *,
    device_memory: int | None = None,
    device_source: str = "--device-memory",
    extra_violations: Iterable[Violation] = (),
    warnings: list[str] | None = None,
) -> DryRunReport:
    """Validate ``config`` for ``world_size`` ranks and estimate every rank; see the module
    docstring. ``work``: the model and micro-batch (``workload.pretraining_workload``)."""
    dims = _validated(config, world_size, extra_violations)
    every = world_size <= ALL_RANKS_UP_TO
    ranks = _estimate(config, dims, work, every)
    memory = config.memory
    report = DryRunReport(
        model=model,
        world_size=world_size,
        layout=f"dp {dims.dp} x tp {dims.tp} x pp {dims.pp}" + (f", ep {dims.ep}" * (dims.ep > 1)),
        precision=config.precision.precision,
        recompute=memory.recompute_granularity or "none",
        micro_batches_per_step=dims.accumulation_steps(
            config.data.micro_batch_size, config.data.global_batch_size
        ),
        plan=ranks[0].plan,
        not_simulated=[f"{name} ({why})" for name, why in NOT_SIMULATED.items()],
        ranks=ranks,
        device_memory=device_memory,
        device_source=device_source,
        warnings=list(warnings or []),
        simulated_all_ranks=every,
    )
    if config.moe.num_experts:
        report.warnings.append(
            "MoE: activations are estimated with dense FFNs (routing depends on the values, "
            f"which a dry run does not have); each token's top-{config.moe.moe_router_topk} "
            "experts keep about that many times the FFN's activations"
        )
    if device_memory is not None and not report.fits:
        report.suggestions = _suggestions(config, world_size, work, device_memory, extra_violations)
    return report


def _validated(
    config: RapidformerConfig, world_size: int, extra: Iterable[Violation]
) -> ParallelDims:
    return validate(
        config,
        world_size,
        builds_optimizer=True,
        runs_loop=True,
        extra=extra,
        on_this_machine=False,
    )


def _estimate(
    config: RapidformerConfig, dims: ParallelDims, work: Workload, every: bool
) -> list[RankMemory]:
    profiles: dict[int, StageProfile] = {}
    return [
        rank_memory(config, dataclasses.replace(dims, rank=rank), work, profiles)
        for rank in simulated_ranks(dims, every)
    ]


def _suggestions(
    config: RapidformerConfig,
    world_size: int,
    work: Workload,
    device_memory: int,
    extra: Iterable[Violation],
) -> list[Suggestion]:
    found: list[Suggestion] = []
    for suggestion in climb(config, world_size, work, extra, device_memory):
        found.append(suggestion)
        if suggestion.fits:
            break
    return found


def worst_rank(
    config: RapidformerConfig, world_size: int, work: Workload, extra: Iterable[Violation] = ()
) -> int:
    """The worst rank's estimate in bytes (each pipeline position's first and last
    data-parallel rank simulated), for a quick answer over many configs."""
    dims = _validated(config, world_size, extra)
    return max(rank.total for rank in _estimate(config, dims, work, every=False))


def climb(
    config: RapidformerConfig,
    world_size: int,
    work: Workload,
    extra: Iterable[Violation] = (),
    device_memory: int | None = None,
) -> Iterator[Suggestion]:
    """Every rung of the ladder (:mod:`rapidformer.dryrun.fit`) that the rules accept on
    ``world_size`` ranks, with its worst rank (each pipeline position's first and last
    data-parallel rank simulated)."""
    extra = list(extra)

    def valid(candidate: RapidformerConfig) -> bool:
        try:
            _validated(candidate, world_size, extra)
        except ConfigError:
            return False
        return True

    for switches, candidate in ladder(config, world_size, valid):
        worst = worst_rank(candidate, world_size, work, extra)
        fit = device_memory is not None and fits(worst, device_memory)
        yield Suggestion(switches, _changed_flags(config, candidate), worst, fit)


def _changed_flags(before: RapidformerConfig, after: RapidformerConfig) -> list[str]:
    """The command-line flags that turn ``before`` into ``after``."""

    flags = []
    for spec in all_fields():
        old = getattr(getattr(before, spec.section), spec.name)
        new = getattr(getattr(after, spec.section), spec.name)
        if old == new:
            continue
        if spec.kind is bool:
            flags.append(spec.flag if new else f"(without {spec.flag})")
        elif new is None:
            flags.append(f"(without {spec.flag})")
        else:
            flags.append(f"{spec.flag} {new}")
    return flags
