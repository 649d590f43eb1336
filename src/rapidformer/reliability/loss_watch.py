"""The checks a training loop runs on each logged window of step losses: a spike (one loss
far above the recent ones) and a loss that keeps rising after warmup. Both only warn."""

from __future__ import annotations

from collections.abc import Iterable

from rapidformer.reliability.rising import RisingLoss
from rapidformer.reliability.spikes import SpikeDetector


class LossWatch:
    def __init__(self, warmup_steps: int, lr: float) -> None:
        self.spikes = SpikeDetector()
        self.rising = RisingLoss(warmup_steps, lr)

    def report(self, window: Iterable[tuple[int, float, bool]], speak: bool) -> None:
        """Check a window's ``(step, loss, skipped)``; skipped steps changed nothing."""
        for step, loss, skipped in window:
            if not skipped:
                self.spikes.report(step, loss, speak)
                self.rising.report(step, loss, speak)
