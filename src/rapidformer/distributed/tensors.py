"""The one helper for the part of a tensor this rank holds, and the one test of whether a tensor
is a DTensor, which needs no import of torch's DTensor package: a tensor can be one only once
that package is loaded (importing it costs a second, and a configuration error must not wait
for it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from rapidformer.loaded import instance_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor."""
    return instance_of(value, "torch.distributed.tensor", "DTensor")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 or tensor-parallel parameters and gradients, expert
    shards), or the tensor itself. In-place work on the result changes the DTensor's values."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
