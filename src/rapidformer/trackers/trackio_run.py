"""Trackio: a local, SQLite-backed tracker (``trackio show`` opens its dashboard). Its store is
``TRACKIO_DIR`` where set, else, for the first run of a process, ``SAVE/trackio``; Trackio
fixes the place when it is first imported. A resumed rapidformer run continues the Trackio run
of the same name in the same project."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from rapidformer.trackers.tracker import TrackedRun, scalars


class TrackioTracker:
    """One Trackio run (Trackio holds one run per process)."""

    name = "trackio"

    def __init__(self, run: TrackedRun) -> None:
        if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ and run.save_dir:
            os.environ["TRACKIO_DIR"] = str(Path(run.save_dir).resolve() / "trackio")
        with self._quiet(run.verbose):
            import trackio

            self.project = run.project or "rapidformer"
            resumed = run.resume_ids.get(self.name)
            self.run_id: str | None = resumed or run.name
            # The run itself, not trackio.log: Trackio keeps its current run in a context
            # variable, which the thread that started it holds and the training loop does not.
            self._run = trackio.init(
                project=self.project,
                name=self.run_id,
                config={**run.config, "run_plan": "\n".join(run.plan)},
                resume="must" if resumed else "allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        self.verbose = run.verbose
        self.where = f"Trackio ({os.environ.get('TRACKIO_DIR', 'its default store')})"

    def write(self, kind: str, record: dict[str, Any]) -> None:
        with self._quiet(self.verbose):
            self._run.log(scalars(kind, record), step=int(record["step"]))

    def close(self) -> None:
        with self._quiet(self.verbose):
            self._run.finish()

    @staticmethod
    def _quiet(verbose: bool) -> contextlib.AbstractContextManager[Any]:
        """Trackio prints its notices to standard output; the run's log is the console's."""
        return contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
