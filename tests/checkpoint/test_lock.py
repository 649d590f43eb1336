"""One run per ``--save`` directory: a second run is refused (exit 2, the holder named) before
it reads or writes anything there, and the first run ends exactly as it does alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint.lock import LOCK_FILE, lock_save_directory
from rapidformer.cli import main
from rapidformer.errors import CheckpointError
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses, shell_env

FLAGS = ["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--save-interval", "2"]
WAITING_SCRIPT = DETERMINISTIC_SCRIPT.with_name("waiting_trainer.py")


def _contents(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but the lock, with its size and modification time."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
        if path.is_file() and path.name != LOCK_FILE
    }


def test_a_held_save_directory_refuses_a_second_run_and_loses_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "run"
    assert main([*FLAGS, "--train-iters", "4", "--save", str(save)]) == 0
    before = _contents(save)
    held = lock_save_directory(str(save), torch.device("cpu"))  # another run, as the OS sees it
    assert held is not None
    capfd.readouterr()
    assert main([*FLAGS, "--train-iters", "6", "--save", str(save)]) == 2
    said = capfd.readouterr().err
    assert f"--save {save} is in use by another run (pid {os.getpid()} on " in said
    assert "Traceback" not in said
    assert _contents(save) == before  # not one checkpoint file read into a change, or removed
    held.release()
    assert main([*FLAGS, "--train-iters", "6", "--save", str(save)]) == 0  # resumes: step 5
    assert sorted(read_losses(save)) == list(range(1, 7))


def test_a_save_path_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(CheckpointError, match=r"--save .*notes.txt is a file, not a directory"):
        lock_save_directory(str(afile), torch.device("cpu"))
    assert afile.read_text() == "mine"


def test_two_processes_on_one_directory_the_second_is_refused_the_first_unharmed(
    tmp_path: Path,
) -> None:
    """The first run is a command of its own, held (before its data) until the second has been
    refused. Its losses then equal the same run alone, bitwise (the same computation)."""
    shared, alone, go = tmp_path / "shared", tmp_path / "alone", tmp_path / "go"
    flags = [*FLAGS, "--train-iters", "6"]
    flags[1] = str(WAITING_SCRIPT)
    first = subprocess.Popen(
        [sys.executable, "-m", "rapidformer", *flags, "--save", str(shared)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=shell_env(OMP_NUM_THREADS="1", RAPIDFORMER_TEST_GO=str(go)),
    )  # fmt: skip
    lock = shared / LOCK_FILE
    deadline = time.monotonic() + 120
    while not (lock.is_file() and lock.read_text().strip()):
        assert first.poll() is None and time.monotonic() < deadline, "no lock taken"
        time.sleep(0.05)
    second = subprocess.run(
        [sys.executable, "-m", "rapidformer", *flags, "--seed", "2", "--save", str(shared)],
        capture_output=True, text=True, timeout=300, env=shell_env(OMP_NUM_THREADS="1"),
    )  # fmt: skip
    go.touch()
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-3000:]
    holder = json.loads(lock.read_text())
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is in use by another run (pid {holder['pid']} on {holder['host']}" in second.stderr
    assert "Traceback" not in second.stderr
    assert main([*flags, "--save", str(alone)]) == 0
    assert read_losses(shared) == read_losses(alone)
