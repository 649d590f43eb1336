"""A model's weights named by one hash: how a run of adapters records the frozen base it was
trained on, so that a resume or a merge onto another base is refused."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def weights_fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the names, shapes, dtypes and bytes of whole tensors, in the given order
    (one tensor at a time: a generator gathers each sharded weight only when it is hashed)."""
    digest = hashlib.sha256()
    for name, tensor in named:
        whole = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(whole.shape)}:{whole.dtype};".encode())
        digest.update(whole.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
