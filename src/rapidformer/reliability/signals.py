"""Stop signals as a request, not a death: the run finishes its step, saves and exits.

Preemptible machines, Slurm (``--signal=USR1@120``) and a user's Ctrl-C all say "stop soon".
Dying at once loses every step since the last checkpoint, so while a run watches
(:class:`StopSignals`), SIGTERM, SIGINT and SIGUSR1 only record that a stop was asked for; the
step guard shares the request with every rank at the next step (:mod:`.guard`), and the loop
writes a checkpoint and ends with :class:`~rapidformer.errors.Preempted`. A second SIGINT
interrupts at once, for a user who really means it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignals:
    """While entered (main thread only), the stop signals set :attr:`received` instead of
    ending the process; the previous handlers come back on exit."""

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.received: str | None = None
        """The name of the first stop signal that arrived (e.g. ``"SIGTERM"``), or None."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        # Python delivers signals to the main thread only; elsewhere (a notebook's worker
        # thread, a test runner's) the default behaviour stays.
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if self.received is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = self.received or name
        if self.announce:  # os.write, not logging: the handler may interrupt a log call
            message = f"[rapidformer] {name} received: stopping after this step, saving first\n"
            os.write(2, message.encode())
