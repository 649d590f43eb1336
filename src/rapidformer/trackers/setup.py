"""Which trackers a run opens (``--report-to``) and what they are told about the run."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.trackers import reported_to
from rapidformer.log import log
from rapidformer.trackers.guard import CallbackTracker, GuardedTrackers
from rapidformer.trackers.tracker import TrackedRun, Tracker

_OPENERS = {
    "jsonl": ("rapidformer.trackers.files", "JsonlTracker"),
    "tensorboard": ("rapidformer.trackers.files", "TensorBoardTracker"),
    "mlflow": ("rapidformer.trackers.mlflow_run", "MlflowTracker"),
    "wandb": ("rapidformer.trackers.wandb_run", "WandbTracker"),
    "trackio": ("rapidformer.trackers.trackio_run", "TrackioTracker"),
}
"""Each tracker's class, imported only when the run names it (its library with it)."""
_UNDER_SAVE = ("jsonl", "tensorboard")


@dataclass(frozen=True)
class TrackerSetup:
    """The trackers to open, the run they report, and a user's callbacks."""

    report_to: Sequence[str]
    run: TrackedRun
    callbacks: Sequence[Callable[[str, dict[str, Any]], None]] = ()

    @classmethod
    def of(
        cls,
        config: RapidformerConfig,
        *,
        plan: Sequence[str] = (),
        resume_ids: dict[str, str] | None = None,
        start_step: int = 0,
        callbacks: Sequence[Callable[[str, dict[str, Any]], None]] = (),
    ) -> TrackerSetup:
        logging, save = config.logging, config.checkpoint.save
        run = TrackedRun(
            save_dir=save,
            name=logging.run_name or (Path(save).resolve().name if save else "rapidformer"),
            project=logging.tracker_project,
            config=config.to_dict(),
            plan=list(plan),
            resume_ids=dict(resume_ids or {}),
            start_step=start_step,
            mlflow_tracking_uri=logging.mlflow_tracking_uri,
            verbose=logging.verbose,
        )
        return cls(reported_to(logging.report_to), run, tuple(callbacks))


START_S = 8.0
"""How long the trackers that talk to a server may take to start, together, before the first
step: one still connecting then is left out (its server is slow or gone), with a warning at
once. A tracker that writes locally (files, a database under --save, W&B offline) is waited
for: it has no server to lose."""


def open_trackers(setup: TrackerSetup) -> GuardedTrackers:
    """The run's trackers, started together in the background, at most :data:`START_S`
    before the first step. One that cannot start (a server that does not answer, a directory
    that cannot be written) warns and is left out: the run goes on without it."""
    run = setup.run
    names = [n for n in setup.report_to if n not in _UNDER_SAVE or run.save_dir is not None]
    if run.save_dir is not None and names:
        Path(run.save_dir).mkdir(parents=True, exist_ok=True)
    starting = {name: _Start(name, run) for name in names}
    deadline = time.monotonic() + START_S
    trackers: list[Tracker] = []
    for name, start in starting.items():
        remote = _talks_to_a_server(name, run)
        start.thread.join(timeout=max(0.0, deadline - time.monotonic()) if remote else None)
        if start.thread.is_alive():
            start.abandon()
            log.warning(
                "the %s tracker did not start within %.0f s (a server that does not answer?); "
                "training goes on without it",
                name,
                START_S,
            )
        elif start.error is not None:
            log.warning(
                "the %s tracker cannot start (%s: %s); training goes on without it",
                name,
                type(start.error).__name__,
                _first_line(start.error),
            )
        elif start.tracker is not None:
            trackers.append(start.tracker)
    if trackers:
        log.info("reporting to %s", "; ".join(f"{t.name}: {t.where}" for t in trackers))
    trackers.extend(CallbackTracker(callback) for callback in setup.callbacks)
    return GuardedTrackers(trackers)


def _talks_to_a_server(name: str, run: TrackedRun) -> bool:
    uri = run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if name == "mlflow":
        return uri.startswith(("http://", "https://"))
    if name == "wandb":
        return os.environ.get("WANDB_MODE", "offline") not in ("offline", "disabled", "dryrun")
    return False


class _Start:
    """One tracker starting in a thread of its own (a daemon: a server that never answers
    cannot keep the process alive)."""

    def __init__(self, name: str, run: TrackedRun) -> None:
        self.tracker: Tracker | None = None
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._abandoned = False
        module, cls = _OPENERS[name]

        def start() -> None:
            try:
                tracker: Tracker = getattr(importlib.import_module(module), cls)(run)
            except Exception as error:  # noqa: BLE001 (a tracker never stops training)
                self.error = error
                return
            with self._lock:
                if not self._abandoned:
                    self.tracker = tracker
                    return
            with contextlib.suppress(Exception):  # late: the run went on without it
                tracker.close()

        self.thread = threading.Thread(target=start, name=f"start {name}", daemon=True)
        self.thread.start()

    def abandon(self) -> None:
        """The run goes on without it; if it starts after all, it closes itself."""
        with self._lock:
            self._abandoned = True


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:300]
