"""ZeRO-1 for tensor-parallel and pipelined models: optimizer state partitioned over dp.

``ZeroRedundancyOptimizer`` broadcasts the parameters it updated with ``dist.broadcast``, which
DTensor parameters (tensor parallelism) do not support. :class:`PartitionedOptimizer` does the
same job on local tensors: every parameter belongs to one data-parallel rank (a greedy split by
size, the same on every rank), each rank builds the real optimizer over its own parameters
only (so only it holds their state), steps it, and broadcasts the updated local values from
the owner. The gradients were averaged over dp before (the stepper). Expert-parallel
parameters differ between the ranks of an ep group, so they are partitioned over the ranks
that hold the same experts (edp) instead. Optimizer math sees whole
DTensor parameters, so LAMB's trust ratio uses whole norms.

It is an ``Optimizer`` whose ``param_groups`` hold every parameter (what schedulers and
clipping see); hyper-parameters set on them (the LR schedule) reach the inner optimizer at each
step, and ``state`` is the inner optimizer's (only this rank's partition).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from rapidformer.distributed.tensors import local_part
from rapidformer.step.optimizer_step import SteppingInner


class PartitionedOptimizer(Optimizer, SteppingInner):
    """``optimizer_class`` over this data-parallel rank's share of the parameters; see the
    module docstring."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[Optimizer],
        group: dist.ProcessGroup,
        expert_ids: frozenset[int] = frozenset(),
        expert_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        """``expert_ids``: expert-parallel parameters, which only the ranks of
        ``expert_group`` (None: this rank alone) hold alike: they are partitioned over it."""
        super().__init__(param_groups, defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        self.owner: dict[int, int] = {}
        self.group_of: dict[int, dist.ProcessGroup | None] = {}
        experts = [p for p in params if id(p) in expert_ids]
        dense = [p for p in params if id(p) not in expert_ids]
        for subset, owners in ((dense, group), (experts, expert_group)):
            size = dist.get_world_size(owners) if owners is not None else 1
            loads = [0] * size
            # Largest first onto the least loaded rank: deterministic, so every rank agrees.
            for param in sorted(subset, key=lambda p: -local_part(p).numel()):
                owner = loads.index(min(loads))
                self.owner[id(param)] = owner
                self.group_of[id(param)] = owners
                loads[owner] += local_part(param).numel()
        mine = [
            dict(g, params=[p for p in g["params"] if self._owns(p)]) for g in self.param_groups
        ]
        self.optim = optimizer_class([g for g in mine if g["params"]], **defaults)
        self._mine = [i for i, g in enumerate(mine) if g["params"]]
        self.state = self.optim.state

    def _owns(self, param: torch.Tensor) -> bool:
        owners = self.group_of[id(param)]
        return self.owner[id(param)] == (dist.get_rank(owners) if owners is not None else 0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for inner, outer in zip(self.optim.param_groups, self._mine, strict=True):
            for key, value in self.param_groups[outer].items():
                if key != "params":
                    inner[key] = value
        loss = self.optim.step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                owners = self.group_of[id(param)]
                if owners is None:
                    continue
                source = dist.get_global_rank(owners, self.owner[id(param)])
                dist.broadcast(local_part(param), src=source, group=owners)
        return loss
