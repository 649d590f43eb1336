"""A run's reporting: the logger with the trackers ``--report-to`` names (continuing those of
the checkpoint it resumed), and the closing line that says where everything went."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rapidformer.config.root import RapidformerConfig
from rapidformer.engine import RapidformerEngine
from rapidformer.log import log
from rapidformer.state import TrainState
from rapidformer.templates.progress import Progress
from rapidformer.trackers import TrackerSetup
from rapidformer.trackers.metrics import MetricsLogger


def open_logger(
    config: RapidformerConfig,
    engine: RapidformerEngine,
    state: TrainState,
    progress: Progress,
    total_steps: int,
    extras: Callable[[], dict[str, Any]],
    callbacks: Sequence[Callable[[str, dict[str, Any]], None]],
) -> MetricsLogger:
    """The run's logger (it reports on rank 0 only); ``progress.trackers`` then holds the
    trackers' run ids, which the checkpoints keep."""
    # The trackers hold the config the run resolved: the global batch it computes, not None.
    data = config.data
    resolved = config.replace(
        global_batch_size=engine.dims.global_batch_size(
            data.micro_batch_size, data.global_batch_size
        )
    )
    trackers = TrackerSetup.of(
        resolved,
        plan=[str(line) for line in state.plan],
        resume_ids=progress.trackers,
        start_step=progress.step,
        callbacks=callbacks,
    )
    logger = MetricsLogger(
        enabled=engine.is_main_process,
        log_interval=config.logging.log_interval,
        total_steps=total_steps,
        save_dir=config.checkpoint.save,
        device=engine.device,
        start_step=progress.step,
        extras=extras,
        mfu=engine.mfu,
        trackers=trackers,
    )
    progress.trackers = logger.run_ids()
    return logger


def say_saved(config: RapidformerConfig, path: Path | None, logger: MetricsLogger) -> None:
    """Where the last checkpoint and the run's reports are (rank 0)."""
    save = config.checkpoint.save
    if path is None or save is None or not logger.enabled:
        return
    log.info(
        "saved: checkpoint %s (the same command resumes from it); reported to %s",
        path,
        ", ".join(logger.tracker_places()) or "the console only",
    )
