"""Saving and resuming the whole training state, atomically.

A checkpoint is a directory ``iter_NNNNNNN`` under ``--save`` holding the model, optimizer,
LR scheduler and loss-scaler states, the trainer's progress (step, epoch, position in the
epoch), the plan and config, and one RNG-state file per rank. It is written into a temporary
directory and renamed into place; the ``latest`` pointer is replaced last. A crash at any moment
therefore leaves either the previous checkpoint or the new one, never half of one.

Model and optimizer are always written whole (consolidated), whatever the sharding: a
ZeroRedundancyOptimizer first gathers its partitions on rank 0 (``consolidate_state_dict``),
an FSDP2 model and its optimizer are gathered with ``torch.distributed.checkpoint.state_dict``
(full state dicts, on rank 0's CPU). The files have the same format as a DDP run's, so a
checkpoint resumes on any number of ranks and under any sharding mode (the shards are cut
again when loading), and ``model.pt`` is already the consolidated state dict to export.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from rapidformer.accel.sharding import is_fsdp
from rapidformer.distributed import process_group
from rapidformer.engine.state import TrainState
from rapidformer.errors import CheckpointError

LATEST = "latest"
PROGRESS = "progress.json"


def iteration_dir(step: int) -> str:
    return f"iter_{step:07d}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    save_dir: str | Path, step: int, state: TrainState, progress: dict[str, Any]
) -> Path:
    """Write a checkpoint of ``state`` at ``step``; every rank must call it."""
    root = Path(save_dir)
    final = root / iteration_dir(step)
    staging = root / f".tmp-{iteration_dir(step)}"
    rank = process_group.rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # debris of a crashed save
        staging.mkdir()
    process_group.barrier()
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), staging / "rng" / f"rank_{rank:05d}.pt")
    model_state = _full_model_state(state)  # collective under sharding: every rank calls it
    optimizer_state = _full_optimizer_state(state)
    if rank == 0:
        # Whole model and optimizer state is on rank 0 (every rank's, under DDP): it writes.
        torch.save(model_state, staging / "model.pt")
        if state.optimizer is not None:
            torch.save(optimizer_state, staging / "optimizer.pt")
        if state.lr_scheduler is not None:
            torch.save(state.lr_scheduler.state_dict(), staging / "lr_scheduler.pt")
        if state.grad_scaler is not None:
            torch.save(state.grad_scaler.state_dict(), staging / "grad_scaler.pt")
        record = dict(
            progress,
            step=step,
            plan=[str(p) for p in state.plan],
            world_size=process_group.world_size(),
        )
        (staging / PROGRESS).write_text(json.dumps(record, indent=2))
    process_group.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(iteration_dir(step) + "\n")
        os.replace(pointer, root / LATEST)  # the pointer moves only once the data is whole
    process_group.barrier()
    return final


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``path`` points at: an ``iter_*`` directory, or a save directory's
    ``latest``. None when ``path`` holds no checkpoint yet."""
    path = Path(path)
    if (path / PROGRESS).is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        return None
    target = path / pointer.read_text().strip()
    if not (target / PROGRESS).is_file():
        raise CheckpointError(
            f"{pointer} points at {target}, which holds no {PROGRESS}; "
            "the checkpoint is damaged: pass --load with an older iter_* dir"
        )
    return target


def load_checkpoint(path: Path, state: TrainState) -> dict[str, Any]:
    """Restore ``state`` (and this rank's RNG) from the checkpoint at ``path``; returns the
    progress record saved with it."""
    try:
        if is_fsdp(state.model):
            # Every rank reads the whole file and keeps its own shard of each tensor.
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(state.model, _load(path / "model.pt"), options=options)
            if state.optimizer is not None:
                named = _by_fqn(state, _load(path / "optimizer.pt"))
                set_optimizer_state_dict(state.model, state.optimizer, named, options=options)
        else:
            state.unwrapped_model.load_state_dict(_load(path / "model.pt"))
            if state.optimizer is not None:  # ZeroRedundancyOptimizer takes the whole too
                state.optimizer.load_state_dict(_load(path / "optimizer.pt"))
        if state.lr_scheduler is not None:
            state.lr_scheduler.load_state_dict(_load(path / "lr_scheduler.pt"))
        if state.grad_scaler is not None:
            state.grad_scaler.load_state_dict(_load(path / "grad_scaler.pt"))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot restore the checkpoint in {path}: {exc}") from exc
    progress: dict[str, Any] = json.loads((path / PROGRESS).read_text())
    rng_file = path / "rng" / f"rank_{process_group.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(_load(rng_file))
    else:  # resumed on more ranks than saved: new ranks get a fresh, still deterministic seed
        torch.manual_seed(progress["step"] * 1000 + process_group.rank())
    return progress


def _full_model_state(state: TrainState) -> dict[str, Any] | None:
    """The whole model state dict on rank 0 (None elsewhere under FSDP2)."""
    if not is_fsdp(state.model):
        return state.unwrapped_model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(state.model, options=options)
    return full if process_group.rank() == 0 else None


def _full_optimizer_state(state: TrainState) -> dict[str, Any] | None:
    """The whole optimizer state dict, in ``torch.optim`` format (parameters numbered in
    group order), on rank 0; None elsewhere when sharded."""
    optimizer = state.optimizer
    if optimizer is None:
        return None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if process_group.rank() == 0 else None
    if not is_fsdp(state.model):
        return optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    named: dict[str, Any] = dict(get_optimizer_state_dict(state.model, optimizer, options=options))
    if process_group.rank() != 0:
        return None
    # FSDP2's full optimizer state is keyed by parameter name; number them as torch.optim does.
    names = [name for group in named["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            dict(group, params=[index[n] for n in group["params"]])
            for group in named["param_groups"]
        ],
    }


def _by_fqn(state: TrainState, indexed: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim``-format state dict keyed by the current optimizer's parameter names."""
    assert state.optimizer is not None
    names = {id(param): name for name, param in state.model.named_parameters()}
    order = [names[id(p)] for group in state.optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[i]: value for i, value in indexed["state"].items()},
        "param_groups": [
            dict(group, params=[order[i] for i in group["params"]])
            for group in indexed["param_groups"]
        ],
    }


def _load(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    return torch.load(file, map_location="cpu", weights_only=False)
