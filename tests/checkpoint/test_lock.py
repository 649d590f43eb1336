"""One run per ``--save`` directory: a second run is refused (exit 2, the holder named) before
it reads or writes anything there, and the first run ends exactly as it does alone."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

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


def _run_forked(argv: list[str], go: Path, stderr: Path, start: Any) -> None:
    """A run of the command in a child forked from this process (a new interpreter per run
    would cost 40 Python starts; what the lock checks is the same across processes)."""
    os.environ["RAPIDFORMER_TEST_GO"] = str(go)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the child ends with os._exit)
    sys.stderr = open(stderr, "w", buffering=1)  # noqa: SIM115
    if start is not None:
        start.wait()  # both runs of a simultaneous trial leave this line together
    code = main(argv)
    sys.stderr.flush()
    os._exit(code)


def test_twenty_trials_of_two_runs_on_one_directory(tmp_path: Path) -> None:
    """10 staggered trials (the second run starts a random 0-300 ms after the first holds the
    lock) and 10 simultaneous ones (both released by one barrier), with different seeds:
    every time one run is refused with exit 2 naming the holder, and the other ends exactly as
    the same run alone (its losses bitwise: the same computation in the same process image)."""
    context = multiprocessing.get_context("fork")
    flags = [*FLAGS, "--train-iters", "4", "--log-interval", "1"]
    flags[1] = str(WAITING_SCRIPT)
    alone = {}
    for seed in ("1", "2"):
        assert main([*flags, "--seed", seed, "--save", str(tmp_path / f"alone{seed}")]) == 0
        alone[seed] = read_losses(tmp_path / f"alone{seed}")
    assert alone["1"] != alone["2"]  # a run that resumed the other's checkpoint would show
    rng, problems = random.Random(0), []
    for trial in range(20):
        simultaneous = trial % 2 == 1
        root = tmp_path / f"trial{trial}"
        shared, go = root / "shared", root / "go"
        root.mkdir()
        start = context.Barrier(2) if simultaneous else None
        runs = {
            seed: context.Process(
                target=_run_forked,
                args=(
                    [*flags, "--seed", seed, "--save", str(shared)],
                    go,
                    root / f"stderr{seed}",
                    start,
                ),
            )
            for seed in ("1", "2")
        }
        runs["1"].start()
        if not simultaneous:
            deadline = time.monotonic() + 120
            while not (shared / LOCK_FILE).is_file() or not (shared / LOCK_FILE).read_text():
                assert runs["1"].is_alive() and time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
        runs["2"].start()
        deadline = time.monotonic() + 120
        while all(run.exitcode is None for run in runs.values()):  # the loser ends first
            assert time.monotonic() < deadline, f"trial {trial}: neither run was refused"
            time.sleep(0.01)
        go.touch()
        for run in runs.values():
            run.join(120)
        codes = {seed: run.exitcode for seed, run in runs.items()}
        winners = [seed for seed, code in codes.items() if code == 0]
        said = {seed: (root / f"stderr{seed}").read_text() for seed in runs}
        if sorted(codes.values()) != [0, 2] or (not simultaneous and winners != ["1"]):
            problems.append(f"trial {trial}: exit codes {codes}\n{said}")
            continue
        (loser,) = set(runs) - set(winners)
        if "is in use by another run (pid " not in said[loser] or "Traceback" in said[loser]:
            problems.append(f"trial {trial}: the refused run said\n{said[loser]}")
        if read_losses(shared) != alone[winners[0]]:
            problems.append(f"trial {trial}: the run that kept {shared} differs from alone")
    assert not problems, "\n\n".join(problems)


def test_a_refused_run_names_the_live_holder_not_an_earlier_one(tmp_path: Path) -> None:
    """The lock file still names a run that has ended (its pid is gone) while the new holder,
    which took the lock, has not rewritten it yet: the refused run waits for the new name."""
    save = tmp_path / "run"
    save.mkdir()
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    earlier = {"host": socket.gethostname(), "pid": int(ended.stdout), "started": "earlier"}
    (save / LOCK_FILE).write_text(json.dumps(earlier))
    handle = open(save / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 (the new holder)
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write_its_name() -> None:
        time.sleep(0.3)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({**earlier, "pid": os.getpid(), "started": "now"}))
        handle.flush()

    writer = threading.Thread(target=write_its_name)
    writer.start()
    try:
        with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {os.getpid()} "):
            lock_save_directory(str(save), torch.device("cpu"))
    finally:
        writer.join()
        handle.close()
