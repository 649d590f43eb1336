"""Learning-rate schedules: linear warmup from 0, then constant, linear or cosine decay to
--min-lr at the last step (Megatron's shape)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from rapidformer.config.root import RapidformerConfig


def warmup_steps(config: RapidformerConfig, total_steps: int) -> int:
    fraction = config.training.lr_warmup_fraction
    if fraction is not None:
        return round(fraction * total_steps)
    return config.training.lr_warmup_iters


def lr_factor(step: int, *, total: int, warmup: int, style: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for the step about to be taken (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    linear = 1.0 - progress
    shape = linear if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_lr_scheduler(
    optimizer: Optimizer, config: RapidformerConfig, total_steps: int
) -> LambdaLR:
    """The schedule the flags describe, over ``total_steps`` optimizer steps."""
    lr = config.training.lr or 0.0
    min_ratio = config.training.min_lr / lr if lr > 0 else 0.0
    warmup = warmup_steps(config, total_steps)
    style = config.training.lr_decay_style

    def factor(step: int) -> float:
        return lr_factor(step, total=total_steps, warmup=warmup, style=style, min_ratio=min_ratio)

    return LambdaLR(optimizer, factor)
