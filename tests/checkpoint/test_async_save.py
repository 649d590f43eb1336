"""``--async-save``: checkpoints written by a background thread hold exactly what synchronous
saves hold, at most one is in flight, and a write that fails stops the run at its next step
with ``latest`` left on the previous checkpoint."""

from __future__ import annotations

import io
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from rapidformer import RapidformerConfig
from rapidformer.checkpoint import find_checkpoint
from rapidformer.checkpoint.background import BackgroundSaver
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


def test_the_copy_keeps_tied_weights_one_tensor() -> None:
    """A GPT's embedding and output layer are one tensor under two names: the host copy holds
    one buffer for both (its file as small as torch.save makes it of the live tensors, one
    weight smaller than untied copies), and the next save copies into the same buffer."""
    weight = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    files = {"model.pt": {"embed": weight.detach(), "head": weight.detach(), "b": torch.ones(3)}}
    saver = BackgroundSaver()
    copy = saver._snapshot(files)["model.pt"]
    assert copy["embed"].data_ptr() == copy["head"].data_ptr() != weight.data_ptr()
    assert torch.equal(copy["head"], weight)

    def size(content: Any) -> int:
        stream = io.BytesIO()
        torch.save(content, stream)
        return len(stream.getvalue())

    untied = {name: tensor.clone() for name, tensor in files["model.pt"].items()}
    assert size(copy) <= size(files["model.pt"]) + 256  # the zip's own bytes may differ
    assert size(untied) - size(copy) >= weight.numel() * weight.element_size()
    again = saver._snapshot(files)["model.pt"]
    assert again["embed"].data_ptr() == copy["embed"].data_ptr()


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
        ({"zero_backend": "deepspeed", "sharding": "zero2"}, "DeepSpeed's engine writes its own"),
    ],
)
def test_async_save_is_refused_where_it_cannot_write_in_the_background(
    tmp_path: Path, flags: dict[str, Any], named: str
) -> None:
    options = {"train_iters": 2, "lr": 1e-3, "async_save": True, "save": str(tmp_path), **flags}
    with pytest.raises(ConfigError, match=f"--async-save=True: .*{named}"):
        validate(RapidformerConfig.from_dict(options), 1)
    for world, sharding in ((2, "none"), (2, "zero3"), (1, "zero1")):  # what it writes now
        allowed = {**options, "save": str(tmp_path), "zero_backend": "native"}
        validate(RapidformerConfig.from_dict({**allowed, "sharding": sharding}), world)


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


LAYOUTS = {"ddp": (), "zero3": ("--sharding", "zero3")}


_REAL_SAVE, _REAL_WRITE = torch.save, FileSystemWriter.write_data


def _slowed_writes(rank: int, failing_step: int | None, pause: float) -> None:
    """Every background write slowed by ``pause`` (so that it overlaps the next steps: the
    copy, not the live tensors, must be what is written); ``failing_step``: rank 1's write of
    that step fails with ENOSPC."""
    real_save, real_write = _REAL_SAVE, _REAL_WRITE

    def in_thread() -> str | None:
        name = threading.current_thread().name
        return name if name.startswith("rapidformer-save-") else None

    def slow_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if in_thread():
            time.sleep(pause)
            if rank == 1 and in_thread() == f"rapidformer-save-{failing_step}":
                raise OSError(28, "No space left on device")
        real_save(obj, path, *args, **kwargs)

    def slow_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_thread():
            time.sleep(pause)
        return real_write(self, *args, **kwargs)

    torch.save = slow_save  # type: ignore[assignment]
    FileSystemWriter.write_data = slow_write  # type: ignore[method-assign]


def _step_9_waits_for_the_stop_request() -> None:
    """Step 9 starts only once this rank's writer has asked to stop (it failed at step 8):
    the request then rides step 9's all-reduce, and every rank stops after step 10."""
    from rapidformer.engine import RapidformerEngine

    requested, steps = threading.Event(), [0]
    real_request, real_step = RapidformerEngine.request_stop, RapidformerEngine.run_step

    def request_stop(self: Any) -> None:
        requested.set()
        real_request(self)

    def run_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        if steps[0] == 9:
            assert requested.wait(120), "the failed write never asked to stop"
        return real_step(self, *args, **kwargs)

    RapidformerEngine.request_stop = request_stop  # type: ignore[method-assign]
    RapidformerEngine.run_step = run_step  # type: ignore[method-assign]


def _two_rank_saves(out: str) -> None:
    """On each of 2 ranks: DDP and ZeRO-3 runs saved synchronously and with --async-save,
    then an async DDP run whose rank 1 fails to write step 4 (what each rank raised goes to
    ``out/failed_R.txt``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # One process group for the five runs: an engine then joins it instead of creating its
    # own (re-creating the env:// group in one process hung in gloo's connect 1 time in 3).
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _slowed_writes(rank, failing_step=None, pause=0.05)
    for layout, flags in LAYOUTS.items():
        for mode in ("sync", "async"):
            extra = ("--async-save",) if mode == "async" else ()
            if (layout, mode) == ("ddp", "async"):  # the launch checks the trackers too
                extra += ("--report-to", "jsonl,mlflow,wandb")
            _fit(Path(out) / f"{layout}-{mode}", *flags, *extra)
    _slowed_writes(rank, failing_step=8, pause=0.0)
    _step_9_waits_for_the_stop_request()
    try:
        _fit(Path(out) / "failing", "--async-save", "--train-iters", "16", "--save-interval", "4")
        said = "no error"
    except CheckpointError as error:
        said = str(error)
    (Path(out) / f"failed_{rank}.txt").write_text(said)


def _whole_state(checkpoint: Path) -> dict[str, Any]:
    """Every tensor a checkpoint holds, in one process: model and optimizer, whatever the
    format (DCP shards converted to one torch.save file by DCP's own tool)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if (checkpoint / "model.pt").is_file():
        return {name: _tensors(checkpoint / name) for name in ("model.pt", "optimizer.pt")}
    whole = checkpoint.parent / f"{checkpoint.name}.whole.pt"
    dcp_to_torch_save(checkpoint / "sharded", whole)
    return dict(_tensors(whole))


@pytest.mark.distributed
def test_background_checkpoints_on_two_ranks_equal_synchronous_ones(tmp_path: Path) -> None:
    """DDP (consolidated files) and ZeRO-3 (DCP shards, each rank's written by its thread
    over the threads' own process group; the DDP run also reports to MLflow and W&B, and its
    2 ranks write one run to each): every checkpoint's model and optimizer state
    equals the synchronous run's, tensor for tensor, and so do the losses. A write failing on
    rank 1 (step 8) is a stop request on the step guard: both ranks stop after the same step
    (before the next save, at 12), write it synchronously, and raise a CheckpointError naming
    step 8, which is never published."""
    from rapidformer.testing import run_distributed

    run_distributed(_two_rank_saves, 2, str(tmp_path))
    for layout in LAYOUTS:
        sync, background = tmp_path / f"{layout}-sync", tmp_path / f"{layout}-async"
        assert read_losses(background) == read_losses(sync), layout
        for step in (2, 4, 6):
            name = f"iter_{step:07d}"
            assert damage(background / name) is None
            ours, theirs = _whole_state(background / name), _whole_state(sync / name)
            assert _equal(ours, theirs), (layout, name)
            for rank in (0, 1):
                rng = f"rng/rank_{rank:05d}.pt"
                assert _equal(_tensors(background / name / rng), _tensors(sync / name / rng))
        shards = list((background / "iter_0000006" / "sharded").glob("*.distcp"))
        assert len(shards) == (2 if layout == "zero3" else 0)
    # Two ranks report one run: one MLflow run, one W&B run (rank 0's).
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'ddp-async' / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert len(client.search_runs(experiments)) == 1
    assert len(list((tmp_path / "ddp-async" / "wandb").glob("offline-run-*"))) == 1
    failing = tmp_path / "failing"
    said = [(tmp_path / f"failed_{rank}.txt").read_text() for rank in (0, 1)]
    assert "step 8 failed (OSError: [Errno 28] No space left on device)" in said[1], said
    assert "step 8 failed on another rank" in said[0], said
    stopped = max(read_losses(failing))
    assert stopped == 10, stopped  # the stop request (step 9's all-reduce), not a save
    written = sorted(p.name for p in failing.iterdir() if p.name.startswith("iter_"))
    assert written == ["iter_0000004", f"iter_{stopped:07d}"] and not list(failing.glob(".tmp-*"))
    assert (failing / "latest").read_text().strip() == written[-1]
    assert damage(failing / written[-1]) is None


def test_a_stop_signal_waits_for_the_write_in_flight_then_saves_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM at step 5 while step 4's background write is still running (slowed to 0.5 s):
    the run publishes step 4, writes step 5 synchronously, and stops (Preempted); the rerun
    ends bitwise where a run without the signal ends."""
    real_save = torch.save
    in_flight_at_stop: list[bool] = []

    def slow_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "rapidformer-save-4":
            time.sleep(0.5)
        real_save(obj, path, *args, **kwargs)

    real_handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(torch, "save", slow_save)
    script = ROOT / "tests" / "scripts" / "faulty_trainer.py"
    flags = ["--user-script", str(script), *TINY_FLAGS, "--train-iters", "8"]
    flags += ["--micro-batch-size", "4", "--save-interval", "4"]
    assert main([*flags, "--save", str(tmp_path / "alone")]) == 0
    monkeypatch.setenv("FAULT_SIGNAL", "5:0:SIGTERM")
    original_finish = BackgroundSaver.finish

    def finish(self: BackgroundSaver) -> None:
        in_flight_at_stop.append(self.in_flight)
        original_finish(self)

    monkeypatch.setattr(BackgroundSaver, "finish", finish)
    save = tmp_path / "stopped"
    assert main([*flags, "--async-save", "--save", str(save)]) == 75
    assert any(in_flight_at_stop)  # step 4's write was still running when step 5 stopped
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000005",
    ]
    assert damage(save / "iter_0000004") is None and find_checkpoint(save) == save / "iter_0000005"
    monkeypatch.delenv("FAULT_SIGNAL")
    assert main([*flags, "--async-save", "--save", str(save)]) == 0
    assert signal.getsignal(signal.SIGTERM) == real_handler
    ours, theirs = (_tensors(d / "iter_0000008" / "model.pt") for d in (save, tmp_path / "alone"))
    assert _equal(ours, theirs)
