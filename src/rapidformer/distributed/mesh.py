"""The device mesh: one named axis per kind of parallelism, built once per job.

:class:`ParallelMesh` wraps a ``torch.distributed.device_mesh.DeviceMesh`` whose axes are the
degrees of :class:`~rapidformer.distributed.dims.ParallelDims` that exceed 1, in the order
pp, dp, tp (pipeline outermost, tensor innermost: a tensor-parallel group is made of
neighbouring ranks, which launchers place on one node). With experts the data-parallel axis is
built from two axes, ``edp`` (the expert-data-parallel replicas) and ``ep`` (ranks that hold
different experts), and ``dp`` is their flattened view.

Every collective in rapidformer names the group it reduces over, taken from here: ``dp`` for
sample counts, losses and metrics; the axes that hold shards for gradient norms; ``world`` for
decisions every rank must share (skipping a step). An axis of degree 1 has no group
(``group(axis)`` is None) and collectives over it are no-ops, as is everything on one process.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rapidformer.distributed.dims import ParallelDims

Axis = Literal["pp", "dp", "tp", "ep", "edp", "world"]


class ParallelMesh:
    """The job's mesh and the process group of each axis; see the module docstring."""

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh | None = None) -> None:
        self.dims = dims
        self.device_mesh = device_mesh
        """None on one process (and for a job whose every axis has degree 1)."""

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> ParallelMesh:
        """The mesh of ``dims`` over the process group that exists (none on one process)."""
        if dims.world_size == 1 or not dist.is_initialized():
            return cls(dims, None)
        edp = dims.dp // dims.ep
        sizes = {"pp": dims.pp, "edp": edp, "ep": dims.ep, "tp": dims.tp}
        if dims.ep == 1:
            sizes = {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp}
        kept = {name: size for name, size in sizes.items() if size > 1}
        if not kept:  # world_size > 1 always leaves one axis above 1
            return cls(dims, None)
        mesh = init_device_mesh(device_type, tuple(kept.values()), mesh_dim_names=tuple(kept))
        if dims.ep > 1 and edp > 1:
            mesh[("edp", "ep")]._flatten("dp")
        return cls(dims, mesh)

    def size(self, axis: Axis) -> int:
        if axis == "world":
            return self.dims.world_size
        if axis == "edp":
            return self.dims.dp // self.dims.ep
        return int(getattr(self.dims, axis))

    def submesh(self, axis: Axis) -> DeviceMesh | None:
        """The one-dimensional mesh of ``axis`` holding this rank (None for degree 1)."""
        if self.device_mesh is None or self.size(axis) == 1:
            return None
        if axis == "world":
            return self.device_mesh
        if axis == "dp" and self.dims.ep > 1 and self.size("edp") == 1:
            axis = "ep"  # every data-parallel rank holds different experts: the same group
        if axis == "edp" and self.dims.ep == 1:
            axis = "dp"  # without experts, every data-parallel rank is an expert replica
        return self.device_mesh[axis]

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        """The process group of ``axis`` holding this rank; None where the axis has degree 1."""
        if axis == "world":
            return dist.group.WORLD if self.device_mesh is not None else None
        mesh = self.submesh(axis)
        return mesh.get_group() if mesh is not None else None

    def describe(self) -> str:
        """``dp 2 x tp 2 x pp 1 (ep 1)`` for the plan."""
        d = self.dims
        return f"dp {d.dp} x tp {d.tp} x pp {d.pp} (ep {d.ep}), {d.world_size} ranks"
