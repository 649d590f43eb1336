"""Validating a config for a run: the general rules and every acceleration's, all at once."""

from __future__ import annotations

from collections.abc import Iterable

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import GENERAL_RULES, RunContext, check
from rapidformer.distributed.dims import ParallelDims
from rapidformer.engine.order import backend
from rapidformer.errors import Violation


def parallel_dims(config: RapidformerConfig, world_size: int, rank: int = 0) -> ParallelDims:
    """The degrees the flags ask for on ``world_size`` ranks."""
    parallel = config.parallel
    return ParallelDims(
        world_size=world_size,
        tp=parallel.tensor_model_parallel_size,
        pp=parallel.pipeline_model_parallel_size,
        ep=config.moe.expert_model_parallel_size,
        rank=rank,
    )


def validate(
    config: RapidformerConfig,
    world_size: int,
    *,
    rank: int = 0,
    builds_optimizer: bool = True,
    runs_loop: bool = True,
    extra: Iterable[Violation] = (),
    on_this_machine: bool = True,
) -> ParallelDims:
    """Check every rule before any process group or model exists; return the parallel degrees
    or raise one :class:`~rapidformer.errors.ConfigError` listing every violation.

    ``builds_optimizer`` is False when the caller supplies its own optimizer (``--lr``
    optional); ``runs_loop`` is False for a hand-written loop driving the engine
    (``--train-iters``/``--epochs`` optional); ``extra`` are a template's own violations.
    ``on_this_machine`` is False for a dry run (no rule about this machine's devices).
    """
    dims = parallel_dims(config, world_size, rank)
    context = RunContext(
        dims,
        builds_optimizer=builds_optimizer,
        runs_loop=runs_loop,
        on_this_machine=on_this_machine,
    )
    check(config, context, (*GENERAL_RULES, *backend(config).rules), extra)
    return dims
