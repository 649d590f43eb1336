"""Writing a checkpoint: every rank writes what it holds into a staging directory, rank 0
seals it with a manifest, flushes it to disk and renames it into place, and ``latest`` moves
last (see :mod:`rapidformer.checkpoint`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rapidformer.checkpoint.directory import (
    ASIDE_PREFIX,
    LATEST,
    PROGRESS,
    STAGING_PREFIX,
    iteration_dir,
    prune,
    read_pointer,
    remove_debris,
    sync_directory,
    sync_files,
)
from rapidformer.checkpoint.formats import format_of
from rapidformer.checkpoint.frozen_base import base_record
from rapidformer.checkpoint.integrity import write_manifest
from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part
from rapidformer.errors import CheckpointError
from rapidformer.own_files import open_own, write_fix
from rapidformer.seeding import rng_state
from rapidformer.state import TrainState


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
    """Never a checkpoint of NaN or infinite weights: one reduction over the parameters where
    they are (a frozen base's too: adapters on it would be saved as if they had learned),
    shared by every rank, one host read per save (not per step)."""
    weights = [local_part(p.detach()) for p in state.parameters]
    finite = [torch.isfinite(p).all() for p in weights if p.numel() and _plain(p)]
    bad = torch.zeros(1, device=state.device)
    if finite:
        bad += torch.stack(finite).logical_not().any().to(bad.device)
    process_group.all_reduce_sum(bad, process_group.world_group())
    if bad.item():
        raise non_finite_error(root, step)


def _plain(tensor: torch.Tensor) -> bool:
    """A floating-point tensor of torch's own (a quantised subclass, NF4's, holds codes)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_floating_point()


def non_finite_error(root: Path, step: int) -> CheckpointError:
    """The error of a save refused for non-finite parameters, naming the last good one."""
    name = read_pointer(root / LATEST) if (root / LATEST).is_file() else None
    last = root / name if name is not None else None
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
        frozen_base=base_record(state),
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
    with open_own(pointer) as stream:
        stream.write(final.name + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(pointer, root / LATEST)  # the pointer moves only once the data is whole
    sync_directory(root)
    shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        prune(root, keep)


def _agree(action: Callable[[], None], staging: Path, step: int, device: torch.device) -> None:
    """Run ``action`` on every rank and share whether it failed anywhere (a collective)."""
    from torch.distributed.checkpoint.api import CheckpointException  # where a save happens

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
        f"previous checkpoint and {staging.parent / LATEST} are untouched. Fix: "
        f"{write_fix(failure)} or pass another --save, then rerun to resume"
    ) from failure
