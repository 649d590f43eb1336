"""Checkpoints survive crashes and damage: every file's size and checksum are recorded and
verified; a damaged latest checkpoint gives way to the previous complete one; --save-keep
prunes; kill -9 at random moments never leaves an unusable save directory."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint import find_checkpoint
from rapidformer.checkpoint.integrity import damage
from rapidformer.cli import main
from rapidformer.errors import CheckpointError
from tests.helpers.trainers import ROOT, TINY_FLAGS, tiny_trainer

FLAGS = ("--train-iters", "6", "--micro-batch-size", "4", "--save-interval", "2")


def _run(save: Path, *flags: str) -> None:
    trainer = tiny_trainer(*FLAGS, "--save", str(save), *flags)
    try:
        trainer.fit()
    finally:
        trainer.engine.close()


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_every_file_is_recorded_with_its_size_and_checksum(tmp_path: Path) -> None:
    _run(tmp_path)
    manifest = json.loads((tmp_path / "iter_0000006" / "manifest.json").read_text())["files"]
    assert set(manifest) == {
        "model.pt",
        "optimizer.pt",
        "lr_scheduler.pt",
        "progress.json",
        "rng/rank_00000.pt",
    }
    model = tmp_path / "iter_0000006" / "model.pt"
    assert manifest["model.pt"]["size"] == model.stat().st_size
    assert damage(tmp_path / "iter_0000006") is None


def test_a_corrupted_latest_checkpoint_gives_way_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path)
    _flip_a_byte(tmp_path / "iter_0000006" / "optimizer.pt")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert "iter_0000006 is damaged" in caplog.text and "iter_0000004 instead" in caplog.text
    assert "optimizer.pt is corrupted" in caplog.text
    # Resuming from it redoes steps 5 and 6 and rewrites the damaged checkpoint.
    _run(tmp_path, "--train-iters", "6")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000006"
    assert damage(tmp_path / "iter_0000006") is None


def test_a_checkpoint_without_a_file_its_format_requires_never_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its manifest lists what the format requires, not only what was there: a checkpoint
    published without model.pt (as two runs in one directory once made) and a manifest
    rewritten to match still fail verification, and ``latest`` on it falls back, saying so.
    Then model.pt deleted outright, and a manifest entry of the wrong type."""
    _run(tmp_path)
    newest = tmp_path / "iter_0000006"
    manifest_file = newest / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest["required"] == sorted(
        ["lr_scheduler.pt", "model.pt", "progress.json", "rng/rank_00000.pt"]
    )
    (newest / "model.pt").unlink()
    del manifest["files"]["model.pt"]
    manifest_file.write_text(json.dumps(manifest))
    assert damage(newest) == f"it is incomplete: {newest / 'model.pt'}, which its format " + (
        "requires, was never written"
    )
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert "iter_0000006 is damaged (it is incomplete" in caplog.text
    older = tmp_path / "iter_0000004"
    (older / "model.pt").unlink()
    assert damage(older) == f"{older / 'model.pt'} is missing"
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["files"]["optimizer.pt"] = "not an entry"
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert "manifest.json is unreadable (TypeError" in str(damage(older))


def test_an_explicit_damaged_checkpoint_is_an_error_naming_the_file(tmp_path: Path) -> None:
    _run(tmp_path / "a")
    model = tmp_path / "a" / "iter_0000004" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=r"model\.pt is truncated or overwritten: 100 bytes"):
        _run(tmp_path / "b", "--load", str(tmp_path / "a" / "iter_0000004"))
    assert find_checkpoint(tmp_path / "b") is None  # nothing saved that a rerun could take
    # Every checkpoint damaged: the error names the latest and says there is no older one.
    for iteration in ("iter_0000002", "iter_0000006"):
        _flip_a_byte(tmp_path / "a" / iteration / "model.pt")
    with pytest.raises(CheckpointError, match=r"iter_0000006, which is damaged .*no older"):
        find_checkpoint(tmp_path / "a")


def test_save_keep_keeps_the_newest_checkpoints_and_debris_is_cleaned(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ".tmp-iter_0000099").mkdir()  # what a save killed half-way leaves
    (tmp_path / ".old-iter_0000002").mkdir()
    _run(tmp_path, "--save-keep", "2")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("iter_", ".")))
    assert names == [".lock", "iter_0000004", "iter_0000006"]  # the lock file stays (unheld)


def test_save_keep_counts_only_whole_checkpoints(tmp_path: Path) -> None:
    """A damaged step-6 checkpoint (model.pt gone): the resume falls back to step 4, and the
    save of step 5 with --save-keep 2 keeps steps 4 and 5, both whole; the damaged one is not
    counted (it used to push step 4 out, leaving one whole checkpoint of the two asked for)."""
    _run(tmp_path, "--save-keep", "3")
    (tmp_path / "iter_0000006" / "model.pt").unlink()
    _run(tmp_path, "--train-iters", "5", "--save-interval", "1", "--save-keep", "2")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_"))
    assert names == ["iter_0000004", "iter_0000005", "iter_0000006"]
    assert damage(tmp_path / "iter_0000004") is None and damage(tmp_path / "iter_0000005") is None
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000005"


KILL_FLAGS = ("--train-iters", "40", "--micro-batch-size", "4", "--save-interval", "1")
KILLS = 12


def _command(save: Path, *extra: str) -> list[str]:
    script = ROOT / "tests" / "scripts" / "faulty_trainer.py"
    flags = [*TINY_FLAGS, *KILL_FLAGS, "--log-interval", "1", "--save", str(save), *extra]
    return [sys.executable, "-m", "rapidformer", "--user-script", str(script), *flags]


def _steps_logged(save: Path) -> int:
    metrics = save / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def test_kill_9_at_random_moments_a_dozen_times_then_the_same_final_weights(
    tmp_path: Path,
) -> None:
    """Half the attempts with --async-save: the end equals an uninterrupted synchronous run's
    (background checkpoints hold what synchronous ones do). Twelve kills (each a fresh process
    of about 5 s) with the seeded draws reach four kills while a checkpoint is staged, one of
    them a background write's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_SLOW_SAVES": "0.02"}
    reference = tmp_path / "reference"
    done = subprocess.run(_command(reference), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    save, rng, resumes, mid_save, newest = tmp_path / "killed", random.Random(0), 0, 0, 0
    mid_background = 0
    for attempt in range(KILLS):
        # Every other attempt writes its checkpoints in the background (--async-save): those
        # kills can land while the thread writes and training goes on.
        background = ("--async-save",) if attempt % 2 else ()
        command = _command(save, *background)
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        logged = _steps_logged(save)
        # Kill at a random moment once this attempt made progress: while training, or (every
        # other time) as soon as a checkpoint is being staged.
        deadline = time.monotonic() + 120
        while _steps_logged(save) == logged and process.poll() is None:
            assert time.monotonic() < deadline, "the resumed run made no progress"
            time.sleep(0.01)
        if rng.random() < 0.5:
            while not list(save.glob(".tmp-*")) and process.poll() is None:
                time.sleep(0.001)
            staged = bool(list(save.glob(".tmp-*")))
            mid_save += staged
            mid_background += staged and bool(background)
        time.sleep(rng.uniform(0.0, 0.05))
        if process.poll() is not None:
            break  # finished before the kill
        process.send_signal(signal.SIGKILL)
        process.wait()
        resumes += 1
        latest = find_checkpoint(save)  # never raises, never names a damaged checkpoint
        if latest is None:  # killed before the first checkpoint was complete
            assert newest == 0
            continue
        assert damage(latest) is None
        step = json.loads((latest / "progress.json").read_text())["step"]
        assert step >= newest  # a kill never loses a complete checkpoint
        newest = step
    final = subprocess.run(_command(save), env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]
    assert resumes == KILLS and mid_save >= 3 and mid_background >= 1, (resumes, mid_save)
    print(
        f"kill -9 loop: {resumes} kills ({mid_save} while a checkpoint was staged, "
        f"{mid_background} of them by a background write), resumed"
    )
    assert not list(save.glob(".tmp-*")) and not list(save.glob(".old-*"))
    a = torch.load(reference / "iter_0000040" / "model.pt")
    b = torch.load(save / "iter_0000040" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_weights_are_never_saved_and_the_last_good_checkpoint_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A parameter turned NaN at the start of step 5 (its steps are then skipped): the save of
    step 6 is refused with exit 2, and ``latest`` still names step 4's checkpoint, whole."""
    monkeypatch.setenv("FAULT_NAN_PARAMETERS", "5:0")
    script = ROOT / "tests" / "scripts" / "faulty_trainer.py"
    flags = [*TINY_FLAGS, "--train-iters", "6", "--save-interval", "2", "--save", str(tmp_path)]
    assert main(["--user-script", str(script), *flags]) == 2
    said = capfd.readouterr().err
    assert "the parameters at step 6 are not finite" in said and "Traceback" not in said
    assert f"{tmp_path / 'iter_0000004'} stays the last good one" in said
    assert (tmp_path / "latest").read_text().strip() == "iter_0000004"
    assert not any(p.name.endswith("iter_0000006") for p in tmp_path.iterdir())
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004"
