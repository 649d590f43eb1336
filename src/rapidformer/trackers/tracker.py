"""What every tracker receives: the run it reports (:class:`TrackedRun`), and each row's
numbers under the names every tracker shares (:func:`scalars`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class TrackedRun:
    """The run as the trackers see it."""

    save_dir: str | None
    name: str
    """The run's name (MLflow, W&B, Trackio)."""
    project: str | None
    """The MLflow experiment, W&B project, Trackio project (None: each one's default)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config, logged once as hyperparameters."""
    plan: list[str] = field(default_factory=list)
    """The run plan's lines, logged once as text."""
    resume_ids: dict[str, str] = field(default_factory=dict)
    """Each tracker's run id from the checkpoint this run resumed (continue that run)."""
    start_step: int = 0
    mlflow_tracking_uri: str | None = None
    verbose: bool = False


class Tracker(Protocol):
    """One destination of the rows."""

    name: str
    where: str
    """What a warning names (a file, a directory, a server)."""
    run_id: str | None
    """The tracker's id of this run, kept in checkpoints (None: nothing to continue)."""

    def write(self, kind: str, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(kind: str, record: dict[str, Any]) -> dict[str, float]:
    """A row's numbers as every tracker names them: ``kind/name`` (``train/loss``)."""
    return {
        f"{kind}/{key}": float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float)
    }


def flat_config(config: dict[str, Any]) -> dict[str, str]:
    """The config's sections as ``section.flag`` -> text (trackers' parameter tables)."""
    flat: dict[str, str] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            for key, value in values.items():
                flat[f"{section}.{key}"] = str(value)
        else:
            flat[section] = str(values)
    return flat
