"""Checkpoint writes are atomic: a crash mid-save leaves the previous checkpoint usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint import LATEST, find_checkpoint, save_checkpoint
from rapidformer.distributed import ParallelDims, ParallelMesh
from rapidformer.errors import CheckpointError
from rapidformer.state import TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step.optimizer_step import TorchStepper


def _state() -> TrainState:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return TrainState(
        model=model,
        device=torch.device("cpu"),
        mesh=ParallelMesh(ParallelDims(world_size=1)),
        forward_backward=EagerForwardBackward(),
        stepper=TorchStepper(clip_grad=1.0),
        optimizer=optimizer,
    )


def test_latest_points_at_a_whole_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, _state(), {"epoch": 0, "consumed": 10})
    assert (tmp_path / LATEST).read_text().strip() == "iter_0000005"
    assert sorted(p.name for p in (tmp_path / "iter_0000005").iterdir()) == [
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "progress.json",
        "rng",
    ]
    assert not list(tmp_path.glob(".tmp-*"))
    record = json.loads((tmp_path / "iter_0000005" / "progress.json").read_text())
    # Plain tensors in one module: the consolidated format, recorded with the layout.
    assert record["format"] == "consolidated"
    assert record["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "ep": 1}


def test_a_crash_while_saving_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    save_checkpoint(tmp_path, 5, state, {"epoch": 0, "consumed": 10})
    real_save = torch.save

    def failing_save(obj: object, path: Path) -> None:
        if Path(path).name == "optimizer.pt":
            raise OSError(28, "No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(torch, "save", failing_save)
    before = {p: p.read_bytes() for p in (tmp_path / "iter_0000005").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=rf"step 10 to {tmp_path}.*No space left"):
        save_checkpoint(tmp_path, 10, state, {"epoch": 0, "consumed": 20})
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000005"
    assert not (tmp_path / "iter_0000010").exists()
    assert not list(tmp_path.glob(".tmp-*"))  # the failed staging directory is gone
    after = {p: p.read_bytes() for p in (tmp_path / "iter_0000005").rglob("*") if p.is_file()}
    assert after == before

    monkeypatch.setattr(torch, "save", real_save)
    save_checkpoint(tmp_path, 10, state, {"epoch": 0, "consumed": 20})  # cleans the debris
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000010"
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_pointer_to_a_missing_checkpoint_names_the_problem(tmp_path: Path) -> None:
    (tmp_path / LATEST).write_text("iter_0000042\n")
    with pytest.raises(CheckpointError, match=r"iter_0000042, which is damaged.*progress\.json"):
        find_checkpoint(tmp_path)
    assert find_checkpoint(tmp_path / "empty") is None
