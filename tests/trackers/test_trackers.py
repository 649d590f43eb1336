"""``--report-to``: each tracker, read back with its own reader, holds every value
``metrics.jsonl`` holds; a resume continues the same MLflow, W&B and Trackio runs without
overlapping steps; a tracker that raises never changes the run; names that are unknown or not
installed are refused before anything is built."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import RapidformerConfig
from rapidformer.engine import validate
from rapidformer.errors import ConfigError
from tests.helpers.trainers import read_losses, tiny_trainer

RUN = ("--micro-batch-size", "4", "--log-interval", "1", "--eval-interval", "2")
RUN += ("--eval-iters", "1", "--save-interval", "2")


def _fit(save: Path, *flags: str, **options: Any) -> None:
    trainer = tiny_trainer(*RUN, "--save", str(save), *flags, **options)
    try:
        trainer.fit()
    finally:
        trainer.engine.close()


def _jsonl(save: Path) -> dict[tuple[str, int], float]:
    """Every number metrics.jsonl holds, by the trackers' name (``kind/name``) and step."""
    values = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        kind, step = row.pop("kind"), row.pop("step")
        for key, value in row.items():
            if isinstance(value, int | float):
                values[(f"{kind}/{key}", step)] = float(value)
    return values


def _tensorboard(save: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        (tag, event.step): event.value
        for tag in events.Tags()["scalars"]
        for event in events.Scalars(tag)
    }


def _mlflow(save: Path) -> tuple[dict[tuple[str, int], float], Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{save / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "rapidformer"]
    (run,) = client.search_runs([experiment.experiment_id])
    values = {
        (key, metric.step): metric.value
        for key in run.data.metrics
        for metric in client.get_metric_history(run.info.run_id, key)
    }
    return values, run


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B offline run file (``run-ID.wandb``), parsed with W&B's own record
    schema. The file is W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    chunks (CRC, length, type: whole, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", path
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:  # zero padding up to the block's end
            position += (block - position % block) % block
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb(save: Path) -> dict[str, Any]:
    """Each offline run of ``save``: its id, config and history values by (name, step)."""
    runs = {}
    for directory in sorted((save / "wandb").glob("offline-run-*")):
        (file,) = directory.glob("run-*.wandb")
        values, config, run_id = {}, {}, None
        for record in _wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                # W&B keeps "train/loss" as the nested key ["train", "loss"]
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                step = int(items.pop("_step", record.history.step.num))
                values.update({(k, step): float(v) for k, v in items.items() if "/" in k})
        runs[directory.name] = {"id": run_id, "config": config, "values": values}
    return runs


def _trackio(name: str) -> dict[tuple[str, int], float]:
    from trackio.sqlite_storage import SQLiteStorage

    values = {}
    for row in SQLiteStorage.get_logs("rapidformer", name):
        step = row.pop("step")
        values.update({(k, step): float(v) for k, v in row.items() if "/" in k})
    return values


def test_every_tracker_holds_what_metrics_jsonl_holds(tmp_path: Path) -> None:
    """train and eval rows of 4 steps, read back by TensorBoard's event reader, the MLflow
    client on its database, W&B's offline run file and Trackio's store: the same names, steps
    and values (TensorBoard stores float32: equal to the value rounded so); the config as
    hyperparameters and the run plan as text, once."""
    for library in ("mlflow", "wandb", "trackio"):
        pytest.importorskip(library)  # rapidformer[trackers] (make test installs it)
    save = tmp_path / "run"
    _fit(save, "--train-iters", "4", "--report-to", "all")
    expected = _jsonl(save)
    assert ("train/loss", 4) in expected and ("eval/eval_loss", 4) in expected
    board = _tensorboard(save)
    assert board == {k: float(torch.tensor(v, dtype=torch.float32)) for k, v in expected.items()}
    mlflow, run = _mlflow(save)
    assert mlflow == expected
    assert run.data.params["training.train_iters"] == "4"
    assert run.data.params["logging.report_to"] == "all"
    # The resolved config: the global batch the run computed (micro 4 x dp 1), not None.
    assert run.data.params["data.global_batch_size"] == run.data.params["data.micro_batch_size"]
    (wandb,) = _wandb(save).values()
    assert wandb["values"] == expected
    assert wandb["config"]["training"]["train_iters"] == 4 and "run_plan" in wandb["config"]
    assert _trackio("run") == expected
    plan = (Path(run.info.artifact_uri.removeprefix("file://")) / "run_plan.txt").read_text()
    assert "forward-backward" in plan or "step" in plan


def test_a_resume_continues_the_same_tracker_runs(tmp_path: Path) -> None:
    """4 steps, then the same command to 8: one MLflow run with steps 1-8 once each; two W&B
    offline directories with the same run id and steps that do not overlap; one Trackio run."""
    for library in ("mlflow", "wandb", "trackio"):
        pytest.importorskip(library)
    save = tmp_path / "resumed"
    flags = ("--report-to", "mlflow,wandb,trackio,jsonl")
    _fit(save, "--train-iters", "4", *flags)
    _fit(save, "--train-iters", "8", *flags)
    expected = _jsonl(save)
    assert sorted({step for _, step in expected}) == list(range(1, 9))
    mlflow, _ = _mlflow(save)  # one run: _mlflow unpacks exactly one
    assert mlflow == expected
    first, second = _wandb(save).values()
    assert first["id"] == second["id"]
    assert {s for _, s in first["values"]} == {1, 2, 3, 4}
    assert {s for _, s in second["values"]} == {5, 6, 7, 8}
    assert {**first["values"], **second["values"]} == expected
    assert _trackio("resumed") == expected
    saved = json.loads((save / "iter_0000008" / "progress.json").read_text())["trackers"]
    assert saved["wandb"] == first["id"] and set(saved) == {"mlflow", "wandb", "trackio"}


def test_a_tracker_that_raises_warns_once_and_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's callback receives every row; one that raises at its third row is dropped with
    one warning, and the run's losses equal the same run's without it, bitwise."""
    rows: list[tuple[str, int]] = []

    def failing(kind: str, record: dict[str, Any]) -> None:
        rows.append((kind, record["step"]))
        if len(rows) == 3:
            raise ConnectionError("the tracking server went away")

    def listening(kind: str, record: dict[str, Any]) -> None:
        rows.append((kind, -record["step"]))

    _fit(tmp_path / "alone", "--train-iters", "6")
    _fit(tmp_path / "callback", "--train-iters", "6", callbacks=[listening])
    assert [step for _, step in rows] == [-1, -2, -2, -3, -4, -4, -5, -6, -6]  # train, eval
    rows.clear()
    _fit(tmp_path / "failing", "--train-iters", "6", callbacks=[failing])
    assert len(rows) == 3
    warnings = [r.getMessage() for r in caplog.records if "no longer written" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionError: the tracking server went away" in warnings[0]
    assert read_losses(tmp_path / "failing") == read_losses(tmp_path / "alone")


@pytest.mark.parametrize(
    ("report_to", "said"),
    [
        ("tensorboard,comet", "comet is not a tracker here"),
        ("all,none", "all and none stand alone"),
        ("wandb", "wandb is not installed. Fix: pip install 'rapidformer[trackers]'"),
    ],
)
def test_report_to_is_checked_before_anything_is_built(
    report_to: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    config = RapidformerConfig.from_dict({"lr": 1e-3, "train_iters": 2, "report_to": report_to})
    with pytest.raises(ConfigError, match=re.escape(f"--report-to='{report_to}': {said}")):
        validate(config, 1)
    no_save = RapidformerConfig.from_dict({"lr": 1e-3, "train_iters": 2, "report_to": "mlflow"})
    with pytest.raises(ConfigError, match="pass --save DIR, or --mlflow-tracking-uri URI"):
        validate(no_save, 1)
    # A tracker's setting without its tracker would do nothing: refused, naming the flag.
    base = {"lr": 1e-3, "train_iters": 2, "save": "run"}
    for setting, flag in (
        ({"mlflow_tracking_uri": "sqlite:///x.db", "report_to": "wandb"}, "--mlflow-tracking-uri"),
        ({"run_name": "baseline"}, "--run-name"),
        ({"tracker_project": "p", "report_to": "tensorboard"}, "--tracker-project"),
    ):
        with pytest.raises(ConfigError, match=f"{flag}=.*no tracker of --report-to"):
            validate(RapidformerConfig.from_dict({**base, **setting}), 1)
    validate(RapidformerConfig.from_dict({**base, "run_name": "b", "report_to": "trackio"}), 1)


def test_a_tracking_server_that_never_answers_costs_seconds_not_minutes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that takes connections and never answers (the worst case: a refused port is
    said at once): the run starts within START_S + 2 s, the warning said first, and no row
    waits for the server."""
    import logging
    import socket
    import time

    from rapidformer.trackers.setup import START_S, TrackerSetup, open_trackers
    from rapidformer.trackers.tracker import TrackedRun

    listener = socket.create_server(("127.0.0.1", 0))  # accepts into its backlog, says nothing
    port = listener.getsockname()[1]
    run = TrackedRun(str(tmp_path), "run", None, mlflow_tracking_uri=f"http://127.0.0.1:{port}")
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="rapidformer"):
            trackers = open_trackers(TrackerSetup(("mlflow", "jsonl"), run))
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    assert elapsed <= START_S + 2.0 <= 10.0, elapsed
    assert "the mlflow tracker did not start within" in caplog.text
    assert trackers.names == ["jsonl"]
    trackers.write("train", {"step": 1, "loss": 1.0})
    trackers.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_a_refused_tracking_server_is_said_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import socket
    import time

    from rapidformer.trackers.setup import TrackerSetup, open_trackers
    from rapidformer.trackers.tracker import TrackedRun

    with socket.socket() as probe:  # a port no one listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = TrackedRun(str(tmp_path), "run", None, mlflow_tracking_uri=f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rapidformer"):
        trackers = open_trackers(TrackerSetup(("mlflow",), run))
    assert time.monotonic() - started < 5.0
    assert re.search(r"the mlflow tracker cannot start \(ConnectionError: http://127\.0\.0\.1:\d+ "
                     r"takes no connection", caplog.text), caplog.text  # fmt: skip
    assert trackers.names == []
