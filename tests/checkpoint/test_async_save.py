"""``--async-save``: checkpoints written by a background thread hold exactly what synchronous
saves hold, at most one is in flight, and a write that fails stops the run at its next step
with ``latest`` left on the previous checkpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import RapidformerConfig
from rapidformer.checkpoint import find_checkpoint
from rapidformer.checkpoint.integrity import damage
from rapidformer.cli import main
from rapidformer.engine import validate
from rapidformer.errors import CheckpointError, ConfigError
from tests.helpers.trainers import ROOT, TINY_FLAGS, read_losses, tiny_trainer

FLAGS = ("--train-iters", "6", "--micro-batch-size", "4", "--save-interval", "2")


def _fit(save: Path, *flags: str) -> None:
    trainer = tiny_trainer(*FLAGS, "--save", str(save), *flags)
    try:
        trainer.fit()
    finally:
        trainer.engine.close()


def _tensors(file: Path) -> dict[str, Any]:
    return torch.load(file, map_location="cpu", weights_only=True)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_background_checkpoints_equal_synchronous_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkpoint's files, tensor for tensor, and the losses; each write slowed so that
    it overlaps the next steps (the snapshot, not the live tensors, is what is written)."""
    real_save = torch.save
    overlapped: list[bool] = []

    def slow_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("rapidformer-save-"):
            time.sleep(0.05)
            overlapped.append(True)
        real_save(obj, path, *args, **kwargs)

    _fit(tmp_path / "sync")
    monkeypatch.setattr(torch, "save", slow_save)
    _fit(tmp_path / "async", "--async-save")
    assert overlapped  # the interval saves were written by the background thread
    assert read_losses(tmp_path / "async") == read_losses(tmp_path / "sync")
    for step in (2, 4, 6):
        name = f"iter_{step:07d}"
        for file in ("model.pt", "optimizer.pt", "lr_scheduler.pt", "rng/rank_00000.pt"):
            ours, theirs = tmp_path / "async" / name / file, tmp_path / "sync" / name / file
            assert _equal(_tensors(ours), _tensors(theirs)), (name, file)
        assert damage(tmp_path / "async" / name) is None
    assert find_checkpoint(tmp_path / "async") == tmp_path / "async" / "iter_0000006"


def test_a_failed_background_write_stops_the_run_and_keeps_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of step 4 fails (a full disk): the run stops with the cause at the first step
    that finds it (5; or the final save of step 6, which is then still written, synchronously,
    before the failure is raised); step 4's staging directory is gone and never published."""
    real_save = torch.save

    def failing_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "rapidformer-save-4":
            raise OSError(28, "No space left on device")
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"step 4 failed \(OSError: .*No space left"):
        _fit(tmp_path, "--async-save")
    latest = (tmp_path / "latest").read_text().strip()
    written = sorted(p.name for p in tmp_path.iterdir() if "iter_" in p.name)
    assert latest in ("iter_0000002", "iter_0000006") and written[-1] == latest
    assert "iter_0000004" not in written and not any(n.startswith(".") for n in written)
    assert damage(tmp_path / latest) is None


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"save": None}, "nothing to save without --save"),
        ({"sharding": "zero1"}, "consolidated format"),
        ({"zero_backend": "deepspeed", "sharding": "zero2"}, "consolidated format"),
    ],
)
def test_async_save_is_refused_where_it_cannot_publish_alone(
    tmp_path: Path, flags: dict[str, Any], named: str
) -> None:
    options = {"train_iters": 2, "lr": 1e-3, "async_save": True, "save": str(tmp_path), **flags}
    with pytest.raises(ConfigError, match=f"--async-save=True: .*{named}"):
        validate(RapidformerConfig.from_dict(options), 1)
    with pytest.raises(ConfigError, match="--async-save=True: background writes are built for one"):
        validate(RapidformerConfig.from_dict({**options, "save": str(tmp_path)}), 2)


def test_non_finite_parameters_are_never_written_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A parameter turned NaN at step 3: the background write of step 4 checks the copy and
    writes nothing; the run stops with exit 2 (at step 5, or at step 6's synchronous save,
    which refuses too), ``latest`` on step 2."""
    monkeypatch.setenv("FAULT_NAN_PARAMETERS", "3:0")
    script = ROOT / "tests" / "scripts" / "faulty_trainer.py"
    flags = [*TINY_FLAGS, *FLAGS, "--async-save", "--save", str(tmp_path)]
    assert main(["--user-script", str(script), *flags]) == 2
    said = capfd.readouterr().err
    assert "are not finite" in said and "Traceback" not in said
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in tmp_path.iterdir() if "iter_" in p.name) == ["iter_0000002"]
