"""``--seed``: one seed for every random number generator a run draws from; and the state of
those generators, captured and restored (checkpoints keep one per rank)."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (torch's on every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (``weights_only`` reads it back)."""
    name, keys, position, has_gauss, gaussian = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state()
    )
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        keys = saved["keys"].numpy().astype(np.uint32)
        saved = (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    np.random.set_state(saved)  # a tuple in checkpoints of earlier versions
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
