"""MLflow: the run in an MLflow experiment, through ``MlflowClient`` (no global state).

Where: ``--mlflow-tracking-uri``, else ``MLFLOW_TRACKING_URI``, else a SQLite database under
``--save`` (``SAVE/mlflow.db``, artifacts in ``SAVE/mlflow-artifacts``): MLflow 3 keeps its
plain file store in maintenance mode and refuses it by default, so a local database is its
local store now. ``mlflow ui --backend-store-uri sqlite:///SAVE/mlflow.db`` shows the run.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rapidformer.trackers.tracker import TrackedRun, flat_config, scalars

DATABASE, ARTIFACTS = "mlflow.db", "mlflow-artifacts"


def tracking_uri(run: TrackedRun) -> str:
    if run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return str(run.mlflow_tracking_uri or os.environ["MLFLOW_TRACKING_URI"])
    assert run.save_dir is not None  # validation asks for --save or a URI
    return f"sqlite:///{(Path(run.save_dir) / DATABASE).resolve()}"


def _probe(uri: str) -> None:
    """A tracking server that does not take a connection within 3 s is said at once (MLflow
    itself would retry for minutes)."""
    parts = urlparse(uri)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=3.0).close()
    except OSError as error:
        raise ConnectionError(f"{uri} takes no connection ({error})") from None


class MlflowTracker:
    """One MLflow run; a resumed rapidformer run continues it."""

    name = "mlflow"

    def __init__(self, run: TrackedRun) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if not run.verbose:
            # Its own notes ("Creating initial MLflow database tables...") and the tracebacks
            # of its retries: a failure reaches the run as one warning line (trackers/guard.py).
            for name in ("mlflow", "alembic", "sqlalchemy"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
        uri = tracking_uri(run)
        _probe(uri)
        # MLflow's own HTTP retries wait minutes for a server that is gone; a run's tracker
        # gives up sooner (the user's own settings win).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.where = uri
        self._client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = run.resume_ids.get(self.name)
        if self.run_id is not None:
            self._client.update_run(self.run_id, status="RUNNING")
            return
        project = run.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rapidformer"
        experiment = self._client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None
            if uri.startswith("sqlite:///") and run.save_dir is not None:
                artifacts = (Path(run.save_dir) / ARTIFACTS).resolve().as_uri()
            experiment_id = self._client.create_experiment(project, artifact_location=artifacts)
        self.run_id = self._client.create_run(experiment_id, run_name=run.name).info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_config(run.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters per batch
            self._client.log_batch(self.run_id, params=params[start : start + 100])
        self._client.log_text(self.run_id, "\n".join(run.plan) + "\n", "run_plan.txt")

    def write(self, kind: str, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None
        now = int(time.time() * 1000)
        step = int(record["step"])
        metrics = [Metric(k, v, now, step) for k, v in scalars(kind, record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id)
