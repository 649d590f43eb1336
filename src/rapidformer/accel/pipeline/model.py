"""A pipeline rank's stages callable as the whole model (evaluation, ``state.model(...)``).

Training runs the stages through a pipeline schedule (:mod:`rapidformer.accel.pipeline.schedule`);
everything else calls the model as if it were whole: :class:`PipelinedModel` runs the stages'
forwards in pipeline order, broadcasts each hop over the pipeline group, and broadcasts the
last stage's outputs to every pipeline rank, so ``eval_step`` and metrics run unchanged on all
of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from rapidformer.accel.pipeline.layout import StageLayout
from rapidformer.distributed.tensors import is_dtensor, local_part

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PipelinedModel(nn.Module):
    """The stages this rank holds, callable as the whole model (evaluation); see the module
    docstring. ``parts`` are the stages, in pipeline order."""

    def __init__(
        self,
        parts: list[nn.Module],
        layout: StageLayout,
        pp_rank: int,
        group: dist.ProcessGroup,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.tp_mesh = tp_mesh
        """Where DTensor outputs (vocab-sharded logits) live; the same on every stage."""
        self.layout = layout
        self.pp_rank = pp_rank
        self.group = group
        self.stage_ids = layout.held(pp_rank)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The stages in order; each later stage takes the previous one's outputs and the
        keyword inputs but ``input_ids`` (as the schedule gives them: ``stage_inputs``)."""
        layout, x = self.layout, None
        parts = dict(zip(self.stage_ids, self.parts, strict=True))
        later = {key: value for key, value in kwargs.items() if key != "input_ids"}
        for stage in range(layout.num_stages):
            owner = layout.owner(stage)
            if stage in parts:
                part = parts[stage]
                x = part(*args, **kwargs) if stage == 0 else part(*_tuple(x), **later)
            last = stage == layout.num_stages - 1
            if last or layout.owner(stage + 1) != owner:
                x = _broadcast(
                    x if owner == self.pp_rank else None, owner, self.group, self.tp_mesh
                )
        return x


def _tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _broadcast(
    value: Any, src_pp_rank: int, group: dist.ProcessGroup, tp_mesh: DeviceMesh | None
) -> Any:
    """``value`` (a tensor, DTensor or tuple of them) from pipeline rank ``src_pp_rank`` to
    every rank of ``group``. Only shapes, dtypes and placements travel as objects: a DTensor
    is rebuilt on the receiver's own ``tp_mesh`` (unpickling a mesh would build process groups
    on some ranks only)."""
    src = dist.get_global_rank(group, src_pp_rank)
    items = list(_tuple(value)) if value is not None else []
    meta: list[Any] = [None]
    if dist.get_rank() == src:
        meta = [[_meta(t) for t in items] + [isinstance(value, tuple | list)]]
    dist.broadcast_object_list(meta, src=src, group=group)
    *metas, was_tuple = meta[0]
    out = []
    for index, info in enumerate(metas):
        local = local_part(items[index]) if items else torch.empty(info[0], dtype=info[1])
        local = local.contiguous()
        dist.broadcast(local, src=src, group=group)
        if info[2] is not None:  # a DTensor: same mesh and placements on every pipeline rank
            placements, shape, stride = info[2]
            assert tp_mesh is not None
            from torch.distributed.tensor import DTensor  # loaded: a DTensor was sent

            local = DTensor.from_local(
                local, tp_mesh, placements, shape=shape, stride=stride, run_check=False
            )
        out.append(local)
    return tuple(out) if was_tuple else out[0]


def _meta(tensor: torch.Tensor) -> tuple[Any, ...]:
    local = local_part(tensor)
    dtensor = None
    if is_dtensor(tensor):
        dtensor = (tensor.placements, tensor.shape, tensor.stride())
    return (tuple(local.shape), local.dtype, dtensor)
