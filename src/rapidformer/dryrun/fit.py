"""Whether every rank fits its device, and which switches make it fit.

A rank fits when its estimate (:mod:`rapidformer.dryrun.estimate`) is at most
:data:`USABLE_FRACTION` of the device's memory: the rest is left to what the estimate does not
count (the CUDA context, cuBLAS and attention workspaces, the caching allocator's
fragmentation).

When a rank does not fit, :data:`LADDER` is climbed in the order a user would try the switches,
cheapest in speed first: bf16, ZeRO-1, ZeRO-2, selective then full recomputation, ZeRO-3, CPU
offload, then tensor and pipeline parallelism. Each rung adds its switch to the ones below it;
a rung that changes nothing, or that the flags' rules refuse on this world size, is passed
over. The climb stops at the first rung whose worst rank fits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rapidformer.config.root import RapidformerConfig
from rapidformer.dryrun.estimate import zero_stage
from rapidformer.errors import ConfigError

USABLE_FRACTION = 0.9

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(text: str) -> int:
    """``"80GB"``, ``"80GiB"``, ``"81920MB"``, ``"24g"`` -> bytes, in binary units: GPUs are
    sold by the GiB they report (an "80 GB" H100 reports 79.6 GiB, a "24 GB" card 24.0), so
    read the size nvidia-smi prints (MiB) for the exact figure."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ConfigError.single(
            "--device-memory",
            text,
            "is not an amount of memory",
            "write it as a number and a unit, e.g. 80GB, 24GiB or 40960MB",
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def fits(total: int, device_memory: int) -> bool:
    return total <= USABLE_FRACTION * device_memory


@dataclass(frozen=True)
class Rung:
    """One switch of the ladder: its name, the flags it sets, when it applies."""

    name: str
    group: str
    """Rungs of one group replace each other (ZeRO-2 replaces ZeRO-1)."""
    flags: dict[str, object]
    applies: Callable[[RapidformerConfig, int], bool]


def _dp(config: RapidformerConfig, world_size: int) -> int:
    parallel = config.parallel
    return world_size // (
        parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    )


def _sharding(stage: int) -> dict[str, object]:
    return {"sharding": f"zero{stage}"}


def _recompute_rank(config: RapidformerConfig) -> int:
    memory = config.memory
    if memory.recompute_granularity is None:
        return 0
    whole = memory.recompute_granularity == "full" and memory.recompute_method != "block"
    return 2 if whole else 1


_SELECTIVE: dict[str, object] = {"recompute_granularity": "selective", "recompute_method": None,
              "recompute_num_layers": None}  # fmt: skip
_FULL: dict[str, object] = {**_SELECTIVE, "recompute_granularity": "full"}

LADDER: tuple[Rung, ...] = (
    Rung("bf16", "precision", {"precision": "bf16"},
         lambda c, w: c.precision.precision == "fp32"),
    Rung("ZeRO-1", "zero", _sharding(1), lambda c, w: _dp(c, w) > 1 and zero_stage(c) < 1),
    Rung("ZeRO-2", "zero", _sharding(2), lambda c, w: _dp(c, w) > 1 and zero_stage(c) < 2),
    Rung("selective recompute", "recompute", _SELECTIVE, lambda c, w: _recompute_rank(c) < 1),
    Rung("full recompute", "recompute", _FULL, lambda c, w: _recompute_rank(c) < 2),
    Rung("ZeRO-3", "zero", _sharding(3), lambda c, w: _dp(c, w) > 1 and zero_stage(c) < 3),
    Rung("CPU offload", "offload", {"cpu_offload": True},
         lambda c, w: _dp(c, w) > 1 and zero_stage(c) >= 2 and not c.memory.cpu_offload),
)  # fmt: skip
"""The switches in the order they are tried (tensor and pipeline parallelism follow)."""


def ladder(
    config: RapidformerConfig, world_size: int, valid: Callable[[RapidformerConfig], bool]
) -> Iterator[tuple[str, RapidformerConfig]]:
    """(switches so far, config) for each rung that applies and that ``valid`` accepts, each
    on top of the last accepted one; tensor parallelism then doubles up to 8 (one node), and
    pipeline parallelism doubles after it."""
    chosen: dict[str, str] = {}  # group -> the rung of it in force, in climbing order
    current = config
    for rung in LADDER:
        if not rung.applies(current, world_size):
            continue
        candidate = current.replace(**rung.flags)
        if valid(candidate):
            current = candidate
            chosen[rung.group] = rung.name
            yield " + ".join(chosen.values()), current
    names = list(chosen.values())
    for axis, limit in (("tensor", 8), ("pipeline", world_size)):
        field = f"{axis}_model_parallel_size"
        degree, best = getattr(current.parallel, field), current
        while degree * 2 <= limit and _others(best, axis) * degree * 2 <= world_size:
            degree *= 2
            candidate = best.replace(**{field: degree})
            if valid(candidate):
                current = candidate
                yield " + ".join([*names, *_parallel_names(current)]), current


def _others(config: RapidformerConfig, axis: str) -> int:
    """The degree of the other model-parallel axis."""
    parallel = config.parallel
    if axis == "tensor":
        return parallel.pipeline_model_parallel_size
    return parallel.tensor_model_parallel_size


def _parallel_names(config: RapidformerConfig) -> list[str]:
    parallel = config.parallel
    names = []
    if parallel.tensor_model_parallel_size > 1:
        names.append(f"tensor parallel {parallel.tensor_model_parallel_size}")
    if parallel.pipeline_model_parallel_size > 1:
        names.append(f"pipeline parallel {parallel.pipeline_model_parallel_size}")
    return names
