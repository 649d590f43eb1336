"""Process groups and parallel degrees."""

from rapidformer.distributed.dims import ParallelDims

__all__ = ["ParallelDims"]
