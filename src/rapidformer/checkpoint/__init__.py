"""Saving and resuming the whole training state, atomically.

A checkpoint is a directory ``iter_NNNNNNN`` under ``--save`` holding the model and optimizer
(in the run's format, see below), the LR scheduler and loss-scaler states, the trainer's
progress (step, epoch, position in the epoch), the parallel layout (dp/tp/pp/ep), the plan and
config, one RNG-state file per rank, and a manifest of every file's size and SHA-256
(:mod:`.integrity`). It is written into a temporary directory and renamed into place; the
``latest`` pointer is replaced last (:mod:`.directory`). A crash at any moment therefore leaves
either the previous checkpoint or the new one, never half of one; a write error on any rank
leaves the previous one and raises on every rank; a damaged file is found before resuming, and
the newest complete checkpoint is used instead.

How model and optimizer are written is the run's checkpoint format
(:class:`rapidformer.state.CheckpointFormat`): ``state.checkpoint_format`` when an engine brings
its own (DeepSpeed), else the native one for what the run holds
(:func:`rapidformer.checkpoint.formats.native_format`: consolidated files, or DCP shards whenever
a parameter is a DTensor or the model has several parts). The format's name is recorded, so a
later run reads the checkpoint with the matching reader: native checkpoints load into any native
layout and rank count; an engine's own format only into that engine.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from rapidformer.checkpoint.directory import (
    ASIDE_PREFIX,
    LATEST,
    PROGRESS,
    STAGING_PREFIX,
    find_checkpoint,
    iteration_dir,
    prune,
    read_progress,
    remove_debris,
)
from rapidformer.checkpoint.formats import (
    NATIVE,
    NATIVE_FORMATS,
    SHARDED,
    load_file,
    native_format,
    read_model_state,
)
from rapidformer.checkpoint.integrity import write_manifest
from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part
from rapidformer.errors import CheckpointError
from rapidformer.state import CheckpointFormat, TrainState

__all__ = [
    "LATEST",
    "PROGRESS",
    "consolidated_model_state",
    "find_checkpoint",
    "gathered_model_state",
    "iteration_dir",
    "load_checkpoint",
    "save_checkpoint",
]


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (``weights_only`` reads it back)."""
    name, keys, position, has_gauss, gaussian = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state()
    )
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        keys = saved["keys"].numpy().astype(np.uint32)
        saved = (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    np.random.set_state(saved)  # a tuple in checkpoints of earlier versions
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def format_of(state: TrainState) -> CheckpointFormat:
    """The format this run writes."""
    return state.checkpoint_format or native_format(state)


def save_checkpoint(
    save_dir: str | Path,
    step: int,
    state: TrainState,
    progress: dict[str, Any],
    *,
    keep: int | None = None,
) -> Path:
    """Write a checkpoint of ``state`` at ``step``; every rank must call it. ``keep``: delete
    all but the newest this many afterwards. A failed write on any rank removes the staging
    directory, leaves the previous checkpoint and ``latest`` as they were, and raises a
    :class:`CheckpointError` naming the path on every rank."""
    root = Path(save_dir)
    final = root / iteration_dir(step)
    staging = root / f"{STAGING_PREFIX}{iteration_dir(step)}"
    refuse_non_finite(root, step, state)
    rank = process_group.rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_debris(root)  # a crashed save's staging directory, pointer, set-aside copy
        staging.mkdir()
    process_group.barrier()
    _agree(lambda: _write_files(staging, step, state, progress), staging, step, state.device)
    # Rank 0 renames once every rank's files are in; the others wait for its verdict.
    required = required_files_of(state)

    def publish() -> None:
        if rank == 0:
            publish_staged(root, staging, final, keep, required)

    _agree(publish, staging, step, state.device)
    return final


def refuse_non_finite(root: Path, step: int, state: TrainState) -> None:
    """Never a checkpoint of NaN or infinite weights: one reduction over the trained
    parameters where they are, shared by every rank, one host read per save (not per step)."""
    trained = [local_part(p) for p in state.parameters if p.requires_grad]
    finite = [torch.isfinite(p).all() for p in trained if p.numel()]
    bad = torch.zeros(1, device=state.device)
    if finite:
        bad += torch.stack(finite).logical_not().any().to(bad.device)
    process_group.all_reduce_sum(bad, process_group.world_group())
    if bad.item():
        raise non_finite_error(root, step)


def non_finite_error(root: Path, step: int) -> CheckpointError:
    """The error of a save refused for non-finite parameters, naming the last good one."""
    pointer = root / LATEST
    last = root / pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    kept = f"{last} stays the last good one" if last else "there is no earlier checkpoint"
    return CheckpointError(
        f"the parameters at step {step} are not finite (NaN or infinity), so no checkpoint "
        f"was written to {root}; {kept}. Fix: resume from it with a lower --lr or a "
        "--clip-grad, or look for the step whose update went wrong (--log-interval 1)"
    )


def _write_files(staging: Path, step: int, state: TrainState, progress: dict[str, Any]) -> None:
    format_of(state).save(state, staging)  # a collective first: each rank writes what it holds
    write_objects(staging, state_files(step, state, progress))


def state_files(step: int, state: TrainState, progress: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's files beside the format's, by name: this rank's RNG state, and on
    rank 0 the schedule's and loss scaler's state and the progress record (as its text)."""
    rank = process_group.rank()
    files: dict[str, Any] = {f"rng/rank_{rank:05d}.pt": rng_state()}
    if rank != 0:
        return files
    if state.lr_scheduler is not None:
        files["lr_scheduler.pt"] = state.lr_scheduler.state_dict()
    scaler = state.precision.grad_scaler
    if scaler is not None:
        files["grad_scaler.pt"] = scaler.state_dict()
    writer = format_of(state)
    record = dict(
        progress,
        **writer.record(state),
        step=step,
        format=writer.name,
        parallel=state.mesh.dims.axes,
        plan=[str(p) for p in state.plan],
        frozen_base=_base_record(state),
        world_size=process_group.world_size(),
    )
    files[PROGRESS] = json.dumps(record, indent=2)
    return files


def write_objects(directory: Path, files: dict[str, Any]) -> None:
    """Each of ``files`` under ``directory``: text as it is, anything else with torch.save;
    each flushed to disk by the rank that wrote it (rank 0's sync before publishing cannot
    reach another machine's page cache)."""
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            torch.save(content, path)
        with open(path, "rb") as stream:
            os.fsync(stream.fileno())


def _base_record(state: TrainState) -> dict[str, Any] | None:
    base = state.frozen_base
    if base is None:
        return None
    return {
        "source": base.source,
        "sha256": base.fingerprint,
        "adapter": base.adapter_config,
        "model_config": base.model_config,
    }


_ADAPTER_KEYS = (
    "r", "lora_alpha", "use_dora", "use_rslora", "target_modules", "modules_to_save",
    "fan_in_fan_out",
)  # fmt: skip
"""What an adapter computes (adapter_config.json's keys): a resume must make the same."""


def _check_base(path: Path, state: TrainState, record: dict[str, Any]) -> None:
    """A checkpoint of adapters resumes only on the base it was trained on, and a whole
    model's checkpoint only without adapters: refused before anything is read."""
    saved, running = record.get("frozen_base"), _base_record(state)
    if saved is None and running is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{path} holds a whole model, and this run trains adapters (--lora-rank): start "
            "from its weights instead (export it, then --pretrained-model-name-or-path)"
        )
    if running is None:
        raise CheckpointError(
            f"{path} holds adapters on the base {saved['source']}: resume it with the same "
            "--lora-* flags, or merge it first (python -m rapidformer.export --merge-lora)"
        )
    if saved["sha256"] != running["sha256"]:
        raise CheckpointError(
            f"{path} holds adapters trained on another base: it was saved on {saved['source']} "
            f"(sha256 {saved['sha256'][:12]}), this run's base {running['source']} is "
            f"{running['sha256'][:12]}. Resume with the base it was trained on"
        )
    differ = [
        f"{key} {saved['adapter'].get(key)!r} there, {running['adapter'].get(key)!r} here"
        for key in _ADAPTER_KEYS
        if saved["adapter"].get(key) != running["adapter"].get(key)
    ]
    if differ:
        raise CheckpointError(
            f"{path} holds other adapters than this run makes ({'; '.join(differ)}): resume "
            "with the --lora-* flags it was saved with"
        )


def required_files_of(state: TrainState) -> list[str]:
    """The files a complete checkpoint of ``state`` holds, whatever else it holds."""
    ranks = process_group.world_size()
    files = [PROGRESS, *(f"rng/rank_{rank:05d}.pt" for rank in range(ranks))]
    if state.lr_scheduler is not None:
        files.append("lr_scheduler.pt")
    if state.precision.grad_scaler is not None:
        files.append("grad_scaler.pt")
    return files + list(getattr(format_of(state), "required_files", lambda s: [])(state))


def publish_staged(
    root: Path, staging: Path, final: Path, keep: int | None, required: list[str]
) -> None:
    """Rank 0: seal the staged checkpoint with its manifest, flush it to disk, and move it
    into place; ``latest`` names it once it is there."""
    write_manifest(staging, required)
    sync_files(staging)
    aside = root / f"{ASIDE_PREFIX}{final.name}"
    if final.exists():  # the same step saved again (a resumed run redoing steps)
        os.replace(final, aside)
    try:
        os.replace(staging, final)
    except OSError:
        if aside.exists() and not final.exists():
            os.replace(aside, final)  # the old copy back where latest may point
        raise
    sync_directory(root)  # the rename on disk before the pointer names it
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w", encoding="utf-8") as stream:
        stream.write(final.name + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(pointer, root / LATEST)  # the pointer moves only once the data is whole
    sync_directory(root)
    shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        prune(root, keep)


def sync_files(directory: Path) -> None:
    """Every file and directory under ``directory`` on disk (``fsync``): a checkpoint is
    published only once a power loss could not take its contents back."""
    for path in sorted(directory.rglob("*"), reverse=True):  # files before their directory
        if path.is_file():
            with open(path, "rb") as stream:
                os.fsync(stream.fileno())
        elif path.is_dir():
            sync_directory(path)
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """A rename in ``directory`` made durable: after a power loss the entry could otherwise
    still name the old file, whatever was flushed into the new one."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:  # some filesystems cannot sync a directory: nothing to wait for
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


def _agree(action: Callable[[], None], staging: Path, step: int, device: torch.device) -> None:
    """Run ``action`` on every rank and share whether it failed anywhere (a collective)."""
    failure: BaseException | None = None
    try:
        action()
    # DCP's CheckpointException derives from BaseException: named so that it is shared too.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 (shared, then raised)
        failure = exc
    failed = torch.tensor([float(failure is not None)], device=device)
    process_group.all_reduce_sum(failed, process_group.world_group())
    if not failed.item():
        return
    if process_group.rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    process_group.barrier()
    cause = f"{type(failure).__name__}: {failure}" if failure is not None else "on another rank"
    raise CheckpointError(
        f"cannot write the checkpoint of step {step} to {staging.parent} ({cause}); the "
        f"previous checkpoint and {staging.parent / LATEST} are untouched. Fix: free space "
        "there or pass another --save, then rerun to resume"
    ) from failure


def saved_format(path: Path, record: dict[str, Any]) -> str:
    """The format a checkpoint was written in (older checkpoints did not record it)."""
    name = record.get("format")
    if isinstance(name, str):
        return name
    return "dcp" if (path / SHARDED).is_dir() else "consolidated"


_BACKENDS = {"consolidated": "--zero-backend native", "dcp": "--zero-backend native"}
"""How a user selects the engine behind a format, where the format is not DeepSpeed's."""


def _backend(format_name: str) -> str:
    return _BACKENDS.get(format_name, f"--zero-backend {format_name}")


def _reader(path: Path, state: TrainState, record: dict[str, Any]) -> CheckpointFormat:
    """Who reads this checkpoint into this run: native formats read each other's files; an
    engine's own format only its own. Refused before anything is read."""
    saved, running = saved_format(path, record), format_of(state)
    if saved == running.name:
        return running
    if saved in NATIVE and running.name in NATIVE:
        return NATIVE_FORMATS[saved]
    fix = (
        f"export it first (python -m rapidformer.export {path} OUT) and start from the "
        "exported weights"
    )
    raise CheckpointError(
        f"{path} was written by {_backend(saved)} and this run uses {_backend(running.name)}: "
        f"resume it with {_backend(saved)}, or {fix}"
    )


def load_checkpoint(path: Path, state: TrainState) -> dict[str, Any]:
    """Restore ``state`` (and this rank's RNG) from the checkpoint at ``path``; returns the
    progress record saved with it."""
    progress: dict[str, Any] = read_progress(path)
    reader = _reader(path, state, progress)
    _check_base(path, state, progress)
    try:
        reader.load(state, path, progress)
        if state.lr_scheduler is not None:
            _load_scheduler(state.lr_scheduler, load_file(path / "lr_scheduler.pt"))
        scaler = state.precision.grad_scaler
        if scaler is not None:
            scaler.load_state_dict(load_file(path / "grad_scaler.pt"))
    # DCP's CheckpointException derives from BaseException: named so it cannot escape.
    except (RuntimeError, KeyError, ValueError, OSError, CheckpointException) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot restore the checkpoint in {path}: {exc}") from exc
    rng_file = path / "rng" / f"rank_{process_group.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(load_file(rng_file))
    else:  # resumed on more ranks than saved: new ranks get a fresh, still deterministic seed
        torch.manual_seed(progress["step"] * 1000 + process_group.rank())
    return progress


def _load_scheduler(scheduler: Any, saved: dict[str, Any]) -> None:
    """Restore an LR schedule's position. Another layout may group the parameters differently
    (tensor parallelism splits groups by kind): the per-group lists (``base_lrs``,
    ``_last_lr``) then keep this run's values, which the same flags made equal, and the
    optimizer's groups got their saved learning rates from the optimizer state."""
    groups = len(scheduler.optimizer.param_groups)
    per_group = [k for k, v in saved.items() if isinstance(v, list) and len(v) != groups]
    for key in per_group:
        saved[key] = [saved[key][0]] * groups
    scheduler.load_state_dict(saved)


def consolidated_model_state(path: Path) -> dict[str, Any]:
    """The whole model state dict of the checkpoint at ``path``, read in this one process
    whichever format and rank count wrote it."""
    record = read_progress(path) if (path / PROGRESS).is_file() else {}
    return read_model_state(path, saved_format(path, record))


def gathered_model_state(state: TrainState) -> dict[str, Any] | None:
    """The whole model state dict of a running job on rank 0 (None elsewhere), whatever holds
    the shards; every rank must call it (FSDP2 and DeepSpeed gather collectively)."""
    return format_of(state).gather_model(state)
