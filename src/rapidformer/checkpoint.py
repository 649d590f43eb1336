"""Saving and resuming the whole training state, atomically.

A checkpoint is a directory ``iter_NNNNNNN`` under ``--save`` holding the model, optimizer,
LR scheduler and loss-scaler states, the trainer's progress (step, epoch, position in the
epoch), the plan and config, and one RNG-state file per rank. It is written into a temporary
directory and renamed into place; the ``latest`` pointer is replaced last. A crash at any moment
therefore leaves either the previous checkpoint or the new one, never half of one.

How model and optimizer are written depends on who holds them:

* unsharded runs (one process, DDP) and ZeRO-1/OSS write them whole (consolidated) from rank 0:
  ``model.pt`` is the plain state dict, ready to export; a ZeroRedundancyOptimizer first
  gathers its partitions on rank 0 (``consolidate_state_dict``);
* FSDP2 runs (SDP/FSDP, ZeRO-2/3) write ``sharded/`` with torch.distributed.checkpoint: each
  rank its own shards, so no rank ever holds the whole model. DCP reshards when loading, so
  the checkpoint resumes on any number of ranks and layout (FSDP2, DDP, one process), and
  :func:`consolidated_model_state` merges the shard files in one process for export;
* DeepSpeed runs write ``deepspeed/`` through DeepSpeed's own save (see accel/deepspeed.py).

Either kind of checkpoint resumes with continuation that matches the uninterrupted run.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from rapidformer.accel import deepspeed
from rapidformer.accel.sharding import is_fsdp
from rapidformer.distributed import process_group
from rapidformer.engine.state import TrainState
from rapidformer.errors import CheckpointError

LATEST = "latest"
PROGRESS = "progress.json"
SHARDED = "sharded"
"""Sub-directory of a checkpoint holding torch.distributed.checkpoint (DCP) shard files."""


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
    if state.deepspeed is not None:
        deepspeed.save(state.deepspeed, staging)  # every rank writes its own partitions
        model_state = optimizer_state = None
    elif is_fsdp(state.model):
        _save_sharded(state, staging / SHARDED)  # every rank writes its own shards
        model_state = optimizer_state = None
    else:
        model_state = state.unwrapped_model.state_dict()  # whole on every rank
        optimizer_state = _full_optimizer_state(state)  # ZeRO-1 gathers: every rank calls
    if rank == 0:
        # Whole model and optimizer state is on rank 0 (every rank's, under DDP): it writes.
        if model_state is not None:
            torch.save(model_state, staging / "model.pt")
        if optimizer_state is not None:
            torch.save(optimizer_state, staging / "optimizer.pt")
        if state.lr_scheduler is not None:
            torch.save(state.lr_scheduler.state_dict(), staging / "lr_scheduler.pt")
        if state.grad_scaler is not None:
            torch.save(state.grad_scaler.state_dict(), staging / "grad_scaler.pt")
        if state.deepspeed is not None:
            progress = dict(progress, deepspeed_stage=state.deepspeed.zero_optimization_stage())
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
    progress: dict[str, Any] = json.loads((path / PROGRESS).read_text())
    _check_backend(path, state, progress)
    try:
        if state.deepspeed is not None:
            deepspeed.load(state.deepspeed, path)
        elif (path / SHARDED).is_dir():
            _load_sharded(state, path / SHARDED)
        elif is_fsdp(state.model):
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
    # DCP's CheckpointException derives from BaseException: named so it cannot escape.
    except (RuntimeError, KeyError, ValueError, OSError, CheckpointException) as exc:
        raise CheckpointError(f"cannot restore the checkpoint in {path}: {exc}") from exc
    rng_file = path / "rng" / f"rank_{process_group.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(_load(rng_file))
    else:  # resumed on more ranks than saved: new ranks get a fresh, still deterministic seed
        torch.manual_seed(progress["step"] * 1000 + process_group.rank())
    return progress


def consolidated_model_state(path: Path) -> dict[str, Any]:
    """The whole model state dict of the checkpoint at ``path``, read in this one process
    whichever backend and rank count wrote it."""
    if deepspeed.is_deepspeed_checkpoint(path):
        return deepspeed.consolidated_state_dict(path)
    if (path / SHARDED).is_dir():
        return _merged_model_shards(path / SHARDED)
    state: dict[str, Any] = _load(path / "model.pt")
    return state


def _merged_model_shards(directory: Path) -> dict[str, Any]:
    """Read every rank's model shards of a DCP checkpoint into whole tensors, in this process
    and without the optimizer state: the metadata gives each tensor's shape and dtype, DCP
    fills them from whichever files hold the pieces."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    template: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            template[key.removeprefix("model.")] = torch.empty(
                item.size, dtype=item.properties.dtype
            )
    content = {"model": template}
    dcp.load(content, checkpoint_id=directory, no_dist=True)
    return content["model"]


def gathered_model_state(state: TrainState) -> dict[str, Any] | None:
    """The whole model state dict of a running job on rank 0 (None elsewhere), whatever holds
    the shards; every rank must call it (FSDP2 and DeepSpeed gather collectively)."""
    if state.deepspeed is not None:
        full: dict[str, Any] = deepspeed.full_state_dict(state.deepspeed)
    elif is_fsdp(state.model):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(state.model, options=options)
    else:
        full = state.unwrapped_model.state_dict()
    return full if process_group.rank() == 0 else None


def _save_sharded(state: TrainState, directory: Path) -> None:
    """torch.distributed.checkpoint: each rank writes the shards it holds, rank 0 the metadata
    that lets any number of ranks read them back (resharding on load)."""
    content: dict[str, Any] = {"model": get_model_state_dict(state.model)}
    if state.optimizer is not None:
        content["optimizer"] = get_optimizer_state_dict(state.model, state.optimizer)
    dcp.save(content, checkpoint_id=directory)


def _load_sharded(state: TrainState, directory: Path) -> None:
    """Read a DCP checkpoint into this run's layout, whatever rank count wrote it: DCP cuts
    each tensor to the shards this rank holds (or reads it whole for an unsharded model)."""
    if isinstance(state.optimizer, ZeroRedundancyOptimizer):
        raise CheckpointError(
            f"{directory.parent} is a sharded (DCP) checkpoint of an SDP/FSDP/ZeRO-2/3 run; "
            "ZeRO-1/OSS cannot read its optimizer shards: resume with one of those flags or "
            "plain DDP, or export it first"
        )
    model = state.model if is_fsdp(state.model) else state.unwrapped_model
    # The templates say which tensors to read and how this rank holds them; a fresh optimizer
    # gets (zero) state first so that its template has the moments to fill.
    content: dict[str, Any] = {"model": get_model_state_dict(model)}
    if state.optimizer is not None:
        content["optimizer"] = get_optimizer_state_dict(model, state.optimizer)
    dcp.load(content, checkpoint_id=directory)
    set_model_state_dict(model, content["model"])
    if state.optimizer is not None:
        set_optimizer_state_dict(model, state.optimizer, content["optimizer"])


def _check_backend(path: Path, state: TrainState, progress: dict[str, Any]) -> None:
    """DeepSpeed's partition files resume only under DeepSpeed, on as many ranks as wrote them;
    consolidated files only natively. Refuse the rest before touching the model."""
    written_by_deepspeed = deepspeed.is_deepspeed_checkpoint(path)
    if written_by_deepspeed and state.deepspeed is None:
        raise CheckpointError(
            f"{path} was written by --zero-backend deepspeed and this run uses the native "
            "backend: resume with --zero-backend deepspeed, or export it first "
            f"(python -m rapidformer.export {path} OUT) and start from the exported weights"
        )
    if state.deepspeed is not None and not written_by_deepspeed:
        raise CheckpointError(
            f"{path} was written by the native backend and this run uses --zero-backend "
            "deepspeed: resume it with --zero-backend native"
        )
    saved_stage = progress.get("deepspeed_stage")
    if state.deepspeed is not None and saved_stage is not None:
        stage = state.deepspeed.zero_optimization_stage()
        if saved_stage != stage:
            raise CheckpointError(
                f"{path} holds DeepSpeed ZeRO stage {saved_stage} partitions and this run "
                f"uses stage {stage}: resume with the ZeRO flag of stage {saved_stage}"
            )
    saved_ranks = progress.get("world_size", 1)
    if written_by_deepspeed and saved_ranks != process_group.world_size():
        raise CheckpointError(
            f"{path} holds DeepSpeed partitions of {saved_ranks} ranks and this run has "
            f"{process_group.world_size()}: resume on {saved_ranks} ranks, or use the native "
            "backend (its checkpoints reshard to any rank count)"
        )


def _full_optimizer_state(state: TrainState) -> dict[str, Any] | None:
    """The whole optimizer state dict, in ``torch.optim`` format (parameters numbered in
    group order), on rank 0; None elsewhere under ZeRO-1."""
    optimizer = state.optimizer
    if optimizer is None:
        return None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if process_group.rank() == 0 else None
    return optimizer.state_dict()


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
