"""``--seed``: one seed for every random number generator a run draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (torch's on every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
