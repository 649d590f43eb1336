"""A loss that keeps rising after warmup: the usual sign of a learning rate too high for the
model (adapters trained at 1e-2 on a small base climb for hundreds of steps and then settle on one
repeated word). Nothing is stopped, because a rise can be a harder stretch of data, but one
warning names ``--lr`` while there is still time to restart.

Single steps are too noisy to compare, so the losses are averaged over blocks of
:data:`BLOCK` steps, and the warning comes when :data:`RISES` block means in a row each rose
and the last is at least :data:`MARGIN` above the lowest block mean since warmup.
"""

from __future__ import annotations

import itertools
import math

from rapidformer.log import log

BLOCK = 10
"""Steps averaged into one block mean."""
RISES = 3
"""Block means in a row that each rose (after warmup) before the warning."""
MARGIN = 0.1
"""How far (as a fraction) the last block mean must lie above the lowest one since warmup."""


class RisingLoss:
    """Feed it each finite step loss after warmup; it warns once when the loss keeps rising."""

    def __init__(self, warmup_steps: int, lr: float) -> None:
        self.warmup_steps = warmup_steps
        self.lr = lr
        self._block: list[float] = []
        self._means: list[float] = []
        self._lowest = math.inf
        self.warned = False

    def rising(self, step: int, loss: float) -> tuple[float, float] | None:
        """(lowest block mean, last block mean) when the loss has kept rising, else None."""
        if step <= self.warmup_steps or not math.isfinite(loss) or self.warned:
            return None
        self._block.append(loss)
        if len(self._block) < BLOCK:
            return None
        mean = sum(self._block) / BLOCK
        self._block.clear()
        self._means.append(mean)
        self._lowest = min(self._lowest, mean)
        recent = self._means[-(RISES + 1) :]
        rose = len(recent) == RISES + 1 and all(b > a for a, b in itertools.pairwise(recent))
        if rose and mean >= (1 + MARGIN) * self._lowest:
            self.warned = True
            return self._lowest, mean
        return None

    def report(self, step: int, loss: float, speak: bool) -> None:
        """Warn (on the rank that ``speak``s) when ``loss`` of ``step`` ends a rise."""
        said = self.rising(step, loss)
        if said is not None and speak:
            lowest, last = said
            log.warning(
                "the loss has risen for %d steps in a row after warmup (mean %.4g, from %.4g "
                "at its lowest): the learning rate may be too high for this model. Fix: "
                "restart with a smaller --lr (this run: %g; try %g)",
                RISES * BLOCK,
                last,
                lowest,
                self.lr,
                self.lr / 10,
            )
