"""The dry run's findings: a text report for the terminal and the same as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rapidformer.dryrun.estimate import RankMemory
from rapidformer.dryrun.fit import USABLE_FRACTION, fits

GIB = 2**30
MIB = 2**20


def _unit(largest: int) -> tuple[str, int]:
    """GiB, or MiB where the largest figure is under 1 GiB (a small model's figures would all
    read 0.00 GiB)."""
    return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


@dataclass(frozen=True)
class Suggestion:
    """A set of switches and the worst rank's estimate with them."""

    switches: str
    flags: list[str]
    worst_total: int
    fits: bool


@dataclass
class DryRunReport:
    """Everything a dry run found; :meth:`text` and :meth:`to_dict` render it."""

    model: str
    world_size: int
    layout: str
    precision: str
    recompute: str
    micro_batches_per_step: int
    plan: list[str]
    not_simulated: list[str]
    ranks: list[RankMemory]
    device_memory: int | None
    device_source: str
    suggestions: list[Suggestion] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    simulated_all_ranks: bool = True

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def best(self) -> RankMemory:
        return min(self.ranks, key=lambda r: (r.total, r.rank))

    @property
    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return fits(self.worst.total, self.device_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "world_size": self.world_size,
            "layout": self.layout,
            "precision": self.precision,
            "recompute": self.recompute,
            "micro_batches_per_step": self.micro_batches_per_step,
            "plan": self.plan,
            "not_simulated": self.not_simulated,
            "simulated_all_ranks": self.simulated_all_ranks,
            "worst_rank": self.worst.rank,
            "best_rank": self.best.rank,
            "ranks": [rank.to_dict() for rank in self.ranks],
            "device_memory": self.device_memory,
            "device_source": self.device_source,
            "usable_fraction": USABLE_FRACTION,
            "fits": self.fits,
            "suggestions": [vars(s) for s in self.suggestions],
            "warnings": self.warnings,
        }

    def text(self) -> str:
        lines = [
            f"rapidformer dry run: {self.model}",
            f"  {self.world_size} ranks ({self.layout}), {self.precision}, recompute "
            f"{self.recompute}, {_micro_batches(self.micro_batches_per_step)} per step "
            "per rank",
            "plan (rank 0):",
            *[f"  {i}. {step}" for i, step in enumerate(self.plan, 1)],
            "not simulated: " + "; ".join(self.not_simulated),
        ]
        which = "every rank" if self.simulated_all_ranks else "each pipeline position's first "
        if not self.simulated_all_ranks:
            which += "and last data-parallel rank"
        worst = self.worst
        unit, size = _unit(worst.total)
        lines.append(f"memory per rank ({unit}; simulated: {which}):")
        for label, rank in (("worst", worst), ("best", self.best)):
            lines.append(f"  {label} {_rank_line(rank, size)}")
        lines.append(
            f"  activations: {worst.micro_batch.peak / size:.2f} {unit} at the peak of one "
            f"micro-batch ({worst.micro_batch.kept / size:.2f} kept after its forward), "
            f"{worst.in_flight} in flight"
        )
        lines.append(f"  buffers: {worst.buffers_what}")
        if self.device_memory is None:
            lines.append(
                "fit: not checked (pass --device-memory, e.g. 80GB; detected on a GPU machine)"
            )
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"fit: the worst rank {verdict} in {USABLE_FRACTION:.0%} of "
                f"{self.device_memory / GIB:.1f} GiB ({self.device_source})"
            )
        if self.suggestions:
            lines.append("switches that make it fit, tried in this order (worst rank):")
            for suggestion in self.suggestions:
                mark = "fits" if suggestion.fits else "no"
                lines.append(
                    f"  {suggestion.switches}: {suggestion.worst_total / size:.2f} {unit} "
                    f"({mark})  " + " ".join(suggestion.flags)
                )
            if not self.suggestions[-1].fits:
                lines.append("  nothing on this ladder fits: more ranks, or a smaller micro-batch")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _micro_batches(number: int) -> str:
    return "1 micro-batch" if number == 1 else f"{number} micro-batches"


def _rank_line(rank: RankMemory, size: int) -> str:
    position = ", ".join(f"{axis} {index}" for axis, index in rank.position.items())
    state = rank.state
    where = (
        f", of which {rank.offloaded / size:.2f} in host memory (--cpu-offload)"
        if rank.offloaded
        else ""
    )
    return (
        f"rank {rank.rank} ({position}): total {rank.total / size:.2f} = model state "
        f"{state.total / size:.2f}{where} [parameters {state.parameters / size:.2f}, gradients "
        f"{state.gradients / size:.2f}, optimizer {state.optimizer / size:.2f}] + buffers "
        f"{rank.buffers / size:.2f} + activations {rank.activations / size:.2f}"
    )
