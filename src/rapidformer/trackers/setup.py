"""Which trackers a run opens (``--report-to``) and what they are told about the run."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import reported_to
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


def open_trackers(setup: TrackerSetup) -> GuardedTrackers:
    """The run's trackers, started. One that cannot start (a server that does not answer, a
    directory that cannot be written) warns and is left out: the run goes on without it."""
    run, trackers = setup.run, []
    for name in setup.report_to:
        if name in _UNDER_SAVE and run.save_dir is None:
            continue  # they write under --save; without it, only the console
        module, cls = _OPENERS[name]
        try:
            if run.save_dir is not None:
                Path(run.save_dir).mkdir(parents=True, exist_ok=True)
            tracker: Tracker = getattr(importlib.import_module(module), cls)(run)
        except Exception as error:  # noqa: BLE001 (a tracker never stops training)
            log.warning(
                "the %s tracker cannot start (%s: %s); training goes on without it",
                name,
                type(error).__name__,
                error,
            )
            continue
        trackers.append(tracker)
    if trackers:
        log.info("reporting to %s", "; ".join(f"{t.name}: {t.where}" for t in trackers))
    trackers.extend(CallbackTracker(callback) for callback in setup.callbacks)
    return GuardedTrackers(trackers)
