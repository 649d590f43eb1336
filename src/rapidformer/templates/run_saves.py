"""When a run saves and how: every --save-interval steps, at its last step and at a stop
signal's; synchronously, or through --async-save's background writer (the last save and the
stop signal's stay synchronous, so a run ends with its checkpoint on disk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rapidformer.checkpoint import save_checkpoint
from rapidformer.checkpoint.background import BackgroundSaver
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed import process_group
from rapidformer.state import TrainState


def due(step: int, interval: int | None) -> bool:
    return interval is not None and step % interval == 0


class RunSaves:
    """The saves of one ``fit()``. ``request_stop``: how a failed background write on several
    ranks stops every rank after the same step (the step guard's stop request)."""

    def __init__(self, config: RapidformerConfig, request_stop: Callable[[], None]) -> None:
        self.checkpoint = config.checkpoint
        self.alone = process_group.world_size() == 1
        self.background: BackgroundSaver | None = None
        if self.checkpoint.async_save:
            timeout = config.parallel.distributed_timeout_minutes
            self.background = BackgroundSaver(None if self.alone else request_stop, timeout)

    def due(self, step: int, final: bool) -> bool:
        """Whether ``step`` saves (``final``: the last step, or a stop signal's)."""
        return bool(self.checkpoint.save) and (final or due(step, self.checkpoint.save_interval))

    def check(self) -> None:
        """Stop the run if a background write failed (before the next step). One process
        only: on several ranks the failure arrives as a stop request at a step every rank
        agrees on, whose final save then raises it."""
        if self.background is not None and self.alone:
            self.background.raise_if_failed()

    def save(self, step: int, state: TrainState, record: dict[str, Any], final: bool) -> Path:
        root, keep = self.checkpoint.save, self.checkpoint.save_keep
        assert root is not None
        if self.background is not None and not final:
            return self.background.save(root, step, state, record, keep=keep)
        if self.background is None:
            return save_checkpoint(root, step, state, record, keep=keep)
        # The last checkpoint (or a stop signal's) is on disk when the run ends: written even
        # when the background write before it failed (the disk may have room again), which
        # is then raised.
        self.background.finish()
        path = save_checkpoint(root, step, state, record, keep=keep)
        self.background.raise_if_failed()
        return path

    def finish(self) -> None:
        """However the run ends, the write in flight completes first."""
        if self.background is not None:
            self.background.finish()
