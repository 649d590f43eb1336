"""The catalogue of bad inputs through the command: each one ends it with a non-zero exit
code and one message that names the input (flag, file, line, key) and says how to fix it; no
Python traceback unless --debug asks for one; nothing left under --save that a later run could
take for a checkpoint.

Every case runs ``rapidformer.cli.main`` in this process (what the ``rapidformer`` command
runs; tests/reliability/test_preemption.py checks the real command's exit code and silence).
The catalogue is tests/helpers/bad_inputs.py.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapidformer import fatal
from rapidformer.checkpoint import find_checkpoint
from rapidformer.cli import load_trainer_class, main
from rapidformer.export import main as export_main
from tests.helpers.bad_inputs import (
    CASES,
    GOOD_ROWS,
    HEADER,
    VICTIM_TEXT,
    WHITE_BOX,
    Case,
    Inputs,
    argv_of,
    build_inputs,
    user_script,
)
from tests.helpers.trainers import LAUNCHER_VARIABLES, shell_env


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return build_inputs(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_with_a_message_naming_it(
    case: Case, inputs: Inputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "save"
    argv = argv_of(case, inputs, save)
    before = _users_files(inputs)
    capsys.readouterr()
    try:
        code = (export_main if case.entry == "export" else main)(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    error = capsys.readouterr().err
    assert code == case.code, error[-2000:]
    for part in case.message:
        assert part in error, f"{part!r} not in:\n{error[-2000:]}"
    assert "Traceback" not in error
    assert not save.exists() or find_checkpoint(save) is None
    assert inputs.victim.read_text() == VICTIM_TEXT  # nothing outside --save was written
    assert _users_files(inputs) == before  # nor the models a run reads


def _users_files(inputs: Inputs) -> dict[Path, bytes]:
    """The files of the user's that a case must leave as they were: the victim and the
    models runs read from."""
    files = [inputs.victim, *inputs.bert.rglob("*"), *inputs.llama.rglob("*")]
    return {f: f.read_bytes() for f in files if f.is_file()}


def test_catalogue_size() -> None:
    assert len(CASES) >= 40


def test_debug_prints_the_traceback(inputs: Inputs, capsys: pytest.CaptureFixture[str]) -> None:
    argv = user_script(
        "raises_debug",
        HEADER + "class A(Base):\n    def build_data(self):\n"
        "        raise ValueError('no such table')\n",
    )(inputs)
    assert main([*argv, "--debug"]) == 1
    error = capsys.readouterr().err
    assert "Traceback (most recent call last)" in error and "no such table" in error
    # --debug was that run's: the next run of the same process (a notebook's next cell, a
    # script's) ends with the one message again. It used to stay on for the process.
    template = load_trainer_class(argv[argv.index("--user-script") + 1])
    with pytest.raises(ValueError, match="no such table") as raised:
        template(argv=argv).fit()
    assert fatal.handle_uncaught(raised.value) == 1
    error = capsys.readouterr().err
    assert "no such table" in error and "Traceback" not in error


def test_the_data_file_checks_leave_parquet_alone(tmp_path: Path) -> None:
    import datasets

    from rapidformer.data.finetune_data import load_splits

    datasets.Dataset.from_list(GOOD_ROWS).to_parquet(str(tmp_path / "train.parquet"))
    assert len(load_splits(str(tmp_path))["train"]) == len(GOOD_ROWS)


def _said(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    error = capsys.readouterr().err
    assert "Traceback" not in error, error[-3000:]
    return code, error


def test_world_size_without_a_launcher_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """WORLD_SIZE=2 typed by hand: refused before any process group (it used to wait out the
    timeout); with the rendezvous variables but no other rank: refused once the (short)
    timeout has passed, with the address it waited at, instead of the store's error."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*WHITE_BOX, "--save", str(tmp_path / "save")]
    code, error = _said(argv, capsys)
    assert code == 2
    assert "WORLD_SIZE=2: this process is one of 2, but RANK, MASTER_ADDR, MASTER_PORT" in error
    assert "torchrun --nproc-per-node 2" in error
    assert not (tmp_path / "save").exists()
    # A group this process joined itself counts (init_method="tcp://..."); one of another size
    # (a group of one an earlier engine left) does not.
    import torch.distributed as dist

    from rapidformer.config.env import LaunchEnv, launch_violations

    for size, refused in ((1, True), (2, False)):  # missing variables, or a group of 1
        with monkeypatch.context() as patch:
            patch.setattr(dist, "is_initialized", lambda: True)
            patch.setattr(dist, "get_world_size", lambda *_: size)  # noqa: B023 (used at once)
            assert bool(launch_violations(LaunchEnv.read())) == refused, size
    # With the rendezvous variables but no other rank: in a new process (an earlier test may
    # have left this one in a group of one).
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = shell_env(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    command = [sys.executable, "-m", "rapidformer", *argv, "--distributed-timeout-minutes", "0.05"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 60, done.stderr[-2000:]
    assert f"rank 0 waited for the other ranks at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_save_directory_that_cannot_be_written_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only --save (a permission error; root ignores file modes, so the error is raised
    where the run opens its first file there), then a full disk: each exit 2 before training,
    naming the directory and the cause."""
    import rapidformer.checkpoint.lock as lock

    save = tmp_path / "save"
    argv = [*WHITE_BOX, "--save", str(save)]

    def read_only(path: object, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(lock, "open_own", read_only)
        code, error = _said(argv, capsys)
    assert code == 2
    assert f"--save {save} cannot be written (Permission denied)" in error
    assert "where this user may write" in error and "free space" not in error
    with monkeypatch.context() as patch:
        patch.setattr(lock.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(9, 9, 4096))
        code, error = _said(argv, capsys)
    assert code == 2
    assert f"--save {save}: its disk is full (4 KiB free)" in error
    assert find_checkpoint(save) is None and not (save / "metrics.jsonl").exists()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_disk_that_fills_mid_run_costs_the_metrics_file_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """metrics.jsonl and TensorBoard's writer thread fail from step 3 on (ENOSPC): one
    warning each, no thread traceback, training goes on. The save of step 4 fails too: exit 2
    naming the cause, ``latest`` on step 2's whole checkpoint."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    import rapidformer.trackers.files as sinks

    real_write, real_save = sinks.JsonlTracker.write, torch.save
    full = OSError(28, "No space left on device")

    def metrics(self: sinks.JsonlTracker, kind: str, record: dict[str, object]) -> None:
        if int(str(record["step"])) >= 3:
            raise full
        real_write(self, kind, record)

    def checkpoint(obj: object, path: object, *args: object, **kwargs: object) -> None:
        if "iter_0000004" in str(path):
            raise full
        real_save(obj, path, *args, **kwargs)

    events: list[bytes] = []

    def event(self: RecordWriter, data: bytes) -> None:  # in TensorBoard's own thread
        events.append(data)
        if len(events) > 12:  # the first rows' scalars are written
            raise full

    monkeypatch.setattr(sinks.JsonlTracker, "write", metrics)
    monkeypatch.setattr(RecordWriter, "write", event)
    monkeypatch.setattr(torch, "save", checkpoint)
    save = tmp_path / "save"
    flags = ["--train-iters", "6", "--save-interval", "2", "--log-interval", "1"]
    code, error = _said([*WHITE_BOX, *flags, "--save", str(save)], capsys)
    assert code == 2
    assert error.count("metrics are no longer written to") == 2  # once per file
    assert f"{save / 'metrics.jsonl'} (OSError: [Errno 28] No space left" in error
    assert error.count(f"metrics are no longer written to {save / 'tensorboard'}") == 1
    assert "train step 3/6" in error  # the console still shows the rows
    assert f"cannot write the checkpoint of step 4 to {save}" in error
    assert "No space left on device" in error
    assert (save / "latest").read_text().strip() == "iter_0000002"
    assert find_checkpoint(save) == save / "iter_0000002"
    assert len((save / "metrics.jsonl").read_text().splitlines()) == 2
