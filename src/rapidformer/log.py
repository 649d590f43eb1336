"""rapidformer's logger, and where its records go (stderr, once a run sets it up).

The numbers a run reports every --log-interval are :mod:`rapidformer.trackers.metrics`'s."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("rapidformer")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not to the one at set-up:
    notebooks and test runners replace it, and the old one may be closed by then. A stream
    given later (``setStream``) is used as given."""

    def __init__(self) -> None:
        super().__init__()  # assigns sys.stderr through the setter below: forgotten next
        self._chosen: Any = None

    @property
    def stream(self) -> Any:
        return self._chosen if self._chosen is not None else sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        self._chosen = value


def setup_console_logging() -> None:
    """Send rapidformer's log records to stderr once (a library must not do this on import)."""
    if not log.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[rapidformer] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
