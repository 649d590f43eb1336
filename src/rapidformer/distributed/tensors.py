"""The one helper for the part of a tensor this rank holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 or tensor-parallel parameters and gradients, expert
    shards), or the tensor itself. In-place work on the result changes the DTensor's values."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
