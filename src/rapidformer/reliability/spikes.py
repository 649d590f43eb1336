"""Megatron's spiky-loss check: a finite loss far above the recent ones is logged.

A spike is not skipped (it may be a hard batch), but it is often the first sign of a
diverging run or a bad shard of data, so the log says where it happened.
"""

from __future__ import annotations

import math
from collections import deque

from rapidformer.log import log

WINDOW = 50
"""How many recent finite step losses the mean is taken over."""
FACTOR = 10.0
"""A loss above this many times the recent mean is a spike."""
WARMUP = 10
"""Steps seen before any loss counts as a spike (the first losses fall fast)."""


class SpikeDetector:
    """Feed it each step's loss; it says when one is a spike."""

    def __init__(self, window: int = WINDOW, factor: float = FACTOR) -> None:
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def spike(self, loss: float) -> float | None:
        """The ratio of ``loss`` to the recent mean when it is a spike, else None."""
        if not math.isfinite(loss):
            return None  # the non-finite guard handles (and logs) those
        ratio = None
        if len(self.recent) >= WARMUP:
            mean = sum(self.recent) / len(self.recent)
            if mean > 0 and loss > self.factor * mean:
                ratio = loss / mean
        self.recent.append(loss)
        return ratio

    def report(self, step: int, loss: float, speak: bool) -> None:
        """Log ``loss`` of ``step`` if it is a spike (on the rank that ``speak``s)."""
        ratio = self.spike(loss)
        if ratio is not None and speak:
            log.warning(
                "step %d: loss %.4g is %.1fx the mean of the recent steps (a loss spike)",
                step,
                loss,
                ratio,
            )
