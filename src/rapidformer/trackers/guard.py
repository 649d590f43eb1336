"""A run's trackers together: each write goes to every one, and one that raises is reported
once (naming where it wrote and why) and dropped. A tracker never stops training, nor loses
the progress made since the last checkpoint; the console still shows every row."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from rapidformer.log import log
from rapidformer.trackers.tracker import Tracker


class GuardedTrackers:
    """The run's trackers; see the module docstring."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self._trackers = trackers

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self._trackers]

    def places(self) -> list[str]:
        """Each tracker's name and where it reports."""
        return [f"{t.name} ({t.where})" for t in self._trackers if t.where != t.name]

    def run_ids(self) -> dict[str, str]:
        """Each tracker's id of this run (what a resume continues)."""
        return {t.name: t.run_id for t in self._trackers if t.run_id is not None}

    def write(self, kind: str, record: dict[str, Any]) -> None:
        for tracker in list(self._trackers):
            self._attempt(tracker, functools.partial(tracker.write, kind, record))

    def close(self) -> None:
        for tracker in list(self._trackers):
            self._attempt(tracker, tracker.close)
        self._trackers = []

    def _attempt(self, tracker: Tracker, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as error:  # noqa: BLE001 (a tracker never stops training)
            self._trackers.remove(tracker)
            log.warning(
                "metrics are no longer written to %s (%s: %s); training goes on, and the "
                "console still shows every row. Fix: free space there (the next checkpoint "
                "needs it too), or bring the %s tracker back",
                tracker.where,
                type(error).__name__,
                error,
                tracker.name,
            )
            with contextlib.suppress(Exception):  # already reported; closing is best effort
                tracker.close()


class CallbackTracker:
    """A user's function called with every row: ``callback(kind, record)`` (a tracker that
    rapidformer does not ship)."""

    run_id: str | None = None

    def __init__(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        self._callback = callback
        self.name = f"callback {getattr(callback, '__qualname__', repr(callback))}"
        self.where = self.name

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self._callback(kind, dict(record))

    def close(self) -> None:
        return None
