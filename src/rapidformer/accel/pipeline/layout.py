"""Which layers each pipeline stage holds, which rank holds each stage, and the bubble.

A leaf of plain integers (no torch), so validation, the plan and the benchmarks use the same
arithmetic as the pipeline itself.

* **Split.** The default split is balanced over ``layers + 2`` units: the embedding and the head
  each count as one layer (on small models they cost about that much), so with 8 layers on 2
  stages the first holds the embedding and 4 layers, the second 4 layers and the head.
  ``--pipeline-layer-split 3,5`` gives the layers per stage explicitly.
* **Placement.** ``S = pp x v`` stages (``v`` virtual stages per rank). The loop schedules (1F1B,
  GPipe, Interleaved1F1B) put stage ``s`` on rank ``s mod pp``; ZBV folds the stages into a V,
  rank ``r`` holding stages ``r`` and ``2 pp - 1 - r`` (so the first and the last stage share
  rank 0).
* **Bubble.** The idle fraction of a step with ``m`` micro-batches: ``(p - 1) / (m + p - 1)`` for
  1F1B and GPipe, ``(p - 1) / (v m + p - 1)`` with ``v`` virtual stages (each rank's idle time is
  cut by ``v``). ZBV's split backward fills part of even that; the same formula with ``v = 2``
  is its upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from rapidformer.distributed.mesh import ParallelMesh

LOOP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "ZBV")
"""Schedules that run several (virtual) stages per rank."""


def balanced_split(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, balancing ``num_layers + 2`` units (the embedding and the head count
    as one layer each); every stage gets at least one layer."""
    if num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot fill {stages} pipeline stages")
    units = num_layers + 2
    ends = [int((s + 1) * units / stages + 0.5) for s in range(stages)]  # half up
    counts, start = [], 0
    for s, end in enumerate(ends):
        layers_end = min(end - 1, num_layers)  # unit 0 is the embedding
        if s == stages - 1:
            layers_end = num_layers
        counts.append(layers_end - start)
        start = layers_end
    # Rounding can leave a stage empty on tiny models: take a layer from the largest.
    for s, count in enumerate(counts):
        if count < 1:
            donor = max(range(stages), key=lambda i: counts[i])
            counts[donor] -= 1
            counts[s] += 1
    return counts


def parse_split(text: str) -> list[int]:
    """``"3,5"`` -> ``[3, 5]``."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated layer counts, got {text!r}") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"every stage needs at least one layer, got {text!r}")
    return counts


@dataclass(frozen=True)
class StageLayout:
    """The stages of one pipeline; see the module docstring."""

    layers_per_stage: tuple[int, ...]
    pp: int
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def virtual(self) -> int:
        """Stages per rank."""
        return self.num_stages // self.pp

    def layers(self, stage: int) -> range:
        start = sum(self.layers_per_stage[:stage])
        return range(start, start + self.layers_per_stage[stage])

    def owner(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        if self.schedule == "ZBV":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def held(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` holds, in pipeline order."""
        return [s for s in range(self.num_stages) if self.owner(s) == pp_rank]

    def bubble(self, microbatches: int) -> float:
        """The schedule's theoretical idle fraction for ``microbatches`` per step."""
        p, v, m = self.pp, self.virtual, microbatches
        return (p - 1) / (v * m + p - 1)

    def describe(self, pp_rank: int) -> str:
        """``stage 0: embedding + layers 0-3`` for each stage of ``pp_rank``."""
        parts = []
        for stage in self.held(pp_rank):
            layers = self.layers(stage)
            what = [f"layers {layers[0]}-{layers[-1]}"]
            if stage == 0:
                what.insert(0, "embedding")
            if stage == self.num_stages - 1:
                what.append("head")
            parts.append(f"stage {stage}: {' + '.join(what)}")
        return "; ".join(parts)


def build_layout(
    num_layers: int,
    pp: int,
    schedule: str,
    split: str | None = None,
    layers_per_virtual_stage: int | None = None,
) -> StageLayout:
    """The layout the flags ask for; ``ValueError`` naming what does not fit."""
    virtual = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    if layers_per_virtual_stage is not None:
        if num_layers % (pp * layers_per_virtual_stage):
            raise ValueError(
                f"{num_layers} layers do not divide into {pp} ranks x stages of "
                f"{layers_per_virtual_stage} layers"
            )
        virtual = num_layers // (pp * layers_per_virtual_stage)
    if schedule not in MULTI_STAGE_SCHEDULES and virtual != 1:
        raise ValueError(f"{schedule} runs one stage per rank, not {virtual}")
    if schedule == "ZBV" and virtual != 2:
        raise ValueError(f"ZBV runs exactly 2 stages per rank, not {virtual}")
    stages = pp * virtual
    if split is not None:
        counts = parse_split(split)
        if len(counts) != stages:
            raise ValueError(f"{len(counts)} stage sizes given for {stages} stages")
        if sum(counts) != num_layers:
            raise ValueError(f"stage sizes sum to {sum(counts)}, the model has {num_layers}")
    elif layers_per_virtual_stage is not None:
        counts = [layers_per_virtual_stage] * stages
    else:
        counts = balanced_split(num_layers, stages)
    return StageLayout(tuple(counts), pp, schedule)


def tied_pair_group(mesh: ParallelMesh, layout: StageLayout) -> dist.ProcessGroup | None:
    """The group of the ranks that hold the first and the last stage of this rank's pipeline
    (None when one rank holds both). Every rank of the job builds every pair's group, in the
    same order, as ``new_group`` requires."""
    last_owner = layout.owner(layout.num_stages - 1)
    if last_owner == 0:
        return None
    device_mesh = mesh.device_mesh
    assert device_mesh is not None and device_mesh.mesh_dim_names is not None
    axis = device_mesh.mesh_dim_names.index("pp")
    ranks = device_mesh.mesh.movedim(axis, 0).reshape(layout.pp, -1)
    mine = None
    for column in ranks.t().tolist():
        pair = [column[0], column[last_owner]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def bubble_formula(layout: StageLayout) -> str:
    if layout.virtual == 1:
        return "(p-1)/(m+p-1)"
    bound = ", an upper bound for ZBV" if layout.schedule == "ZBV" else ""
    return f"(p-1)/(v*m+p-1), v={layout.virtual}{bound}"
