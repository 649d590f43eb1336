"""Parallel degrees, the device mesh and process groups."""

from rapidformer.distributed.dims import ParallelDims
from rapidformer.distributed.mesh import ParallelMesh

__all__ = ["ParallelDims", "ParallelMesh"]
