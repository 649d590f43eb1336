"""Reading a checkpoint back: into a running job (every rank, its own share), or as one
whole model state in a single process (export, ``--pretrained-checkpoint``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rapidformer.checkpoint.directory import PROGRESS, read_progress
from rapidformer.checkpoint.formats import (
    NATIVE,
    NATIVE_FORMATS,
    format_of,
    load_torch_file,
    read_model_state,
    saved_format,
)
from rapidformer.checkpoint.frozen_base import check_base
from rapidformer.distributed import process_group
from rapidformer.errors import CheckpointError
from rapidformer.seeding import set_rng_state
from rapidformer.state import CheckpointFormat, TrainState

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
    from torch.distributed.checkpoint.api import CheckpointException  # where a load happens

    progress: dict[str, Any] = read_progress(path)
    reader = _reader(path, state, progress)
    check_base(path, state, progress)
    try:
        reader.load(state, path, progress)
        if state.lr_scheduler is not None:
            _load_scheduler(state.lr_scheduler, load_torch_file(path / "lr_scheduler.pt"))
        scaler = state.precision.grad_scaler
        if scaler is not None:
            scaler.load_state_dict(load_torch_file(path / "grad_scaler.pt"))
    # DCP's CheckpointException derives from BaseException: named so it cannot escape.
    except (RuntimeError, KeyError, ValueError, OSError, CheckpointException) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot restore the checkpoint in {path}: {exc}") from exc
    rng_file = path / "rng" / f"rank_{process_group.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(load_torch_file(rng_file))
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
