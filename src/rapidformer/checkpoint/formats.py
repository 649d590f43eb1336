"""The native checkpoint formats: consolidated files, or torch.distributed.checkpoint shards.

A run's format is chosen by what it holds (:func:`native_format`):

* :class:`ConsolidatedFormat` (``model.pt``, ``optimizer.pt``): when every parameter is a plain
  tensor and the model is one module (one process, DDP, ZeRO-1/OSS). Rank 0 writes the whole
  state dicts, ready to export; a ZeroRedundancyOptimizer first gathers its partitions there.
* :class:`DistributedFormat` (``sharded/``, torch.distributed.checkpoint): whenever any
  parameter is a DTensor (FSDP2 for ZeRO-2/3, tensor parallelism) or the model has several parts
  (pipeline stages). Each rank writes the shards it holds under names that do not depend on the
  layout (the model's own state-dict keys), and DCP reshards on load: a checkpoint resumes on
  any number of ranks and any native layout.

Either kind loads into any native run: a consolidated file into FSDP2 (each rank keeps its shard
of each whole tensor), shards into one process. The DeepSpeed backend brings its own format
(:mod:`rapidformer.accel.deepspeed_state`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from rapidformer.distributed import process_group
from rapidformer.errors import CheckpointError
from rapidformer.state import CheckpointFormat, TrainState

SHARDED = "sharded"
"""Sub-directory of a checkpoint holding torch.distributed.checkpoint (DCP) shard files."""
NATIVE = ("consolidated", "dcp")


def load_file(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    return torch.load(file, map_location="cpu", weights_only=False)


def _has_dtensors(state: TrainState) -> bool:
    return any(isinstance(p, DTensor) for p in state.parameters)


def _single_part(state: TrainState) -> nn.Module:
    if len(state.model_parts) != 1:
        raise CheckpointError(
            f"this rank holds {len(state.model_parts)} model parts; their optimizer state is "
            "saved per part by the pipeline engine, not by one optimizer"
        )
    return state.model_parts[0]


class ConsolidatedFormat:
    """``model.pt`` / ``optimizer.pt``, whole, written by rank 0."""

    name = "consolidated"

    def save(self, state: TrainState, directory: Path) -> None:
        model_state = state.unwrapped_model.state_dict()  # whole on every rank
        optimizer_state = _full_optimizer_state(state)  # ZeRO-1 gathers: every rank calls
        if process_group.rank() == 0:
            torch.save(model_state, directory / "model.pt")
            if optimizer_state is not None:
                torch.save(optimizer_state, directory / "optimizer.pt")

    def record(self, state: TrainState) -> dict[str, Any]:
        return {}

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        model_state = load_file(directory / "model.pt")
        if _has_dtensors(state):
            # Every rank reads the whole file and keeps its own shard of each tensor.
            options = StateDictOptions(full_state_dict=True)
            model = _single_part(state)
            set_model_state_dict(model, model_state, options=options)
            if state.optimizer is not None:
                named = _by_fqn(model, state.optimizer, load_file(directory / "optimizer.pt"))
                set_optimizer_state_dict(model, state.optimizer, named, options=options)
            return
        state.unwrapped_model.load_state_dict(model_state)
        if state.optimizer is not None:  # ZeroRedundancyOptimizer takes the whole too
            state.optimizer.load_state_dict(load_file(directory / "optimizer.pt"))

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:
        return state.unwrapped_model.state_dict() if process_group.rank() == 0 else None


class DistributedFormat:
    """torch.distributed.checkpoint: each rank writes its shards, rank 0 the metadata that
    lets any number of ranks read them back (resharding on load)."""

    name = "dcp"

    def save(self, state: TrainState, directory: Path) -> None:
        content: dict[str, Any] = {"model": _model_state(state)}
        if state.optimizer is not None:
            content["optimizer"] = get_optimizer_state_dict(_single_part(state), state.optimizer)
        dcp.save(content, checkpoint_id=directory / SHARDED)

    def record(self, state: TrainState) -> dict[str, Any]:
        return {}

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        if isinstance(state.optimizer, ZeroRedundancyOptimizer):
            raise CheckpointError(
                f"{directory} is a sharded (DCP) checkpoint; ZeRO-1/OSS cannot read its "
                "optimizer shards: resume with an SDP/FSDP/ZeRO-2/3 flag or plain DDP, or "
                "export it first"
            )
        # The templates say which tensors to read and how this rank holds them; a fresh
        # optimizer gets (zero) state first so that its template has the moments to fill.
        templates = [get_model_state_dict(part) for part in state.model_parts]
        content: dict[str, Any] = {"model": {k: v for t in templates for k, v in t.items()}}
        if state.optimizer is not None:
            content["optimizer"] = get_optimizer_state_dict(_single_part(state), state.optimizer)
        dcp.load(content, checkpoint_id=directory / SHARDED)
        for part, template in zip(state.model_parts, templates, strict=True):
            set_model_state_dict(part, {name: content["model"][name] for name in template})
        if state.optimizer is not None:
            set_optimizer_state_dict(_single_part(state), state.optimizer, content["optimizer"])

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = {}
        for part in state.model_parts:
            full.update(get_model_state_dict(part, options=options))
        return full if process_group.rank() == 0 else None


def native_format(state: TrainState) -> CheckpointFormat:
    """The native format for what this run holds (see the module docstring)."""
    if _has_dtensors(state) or len(state.model_parts) > 1:
        return DistributedFormat()
    return ConsolidatedFormat()


NATIVE_FORMATS: dict[str, CheckpointFormat] = {
    "consolidated": ConsolidatedFormat(),
    "dcp": DistributedFormat(),
}


def _model_state(state: TrainState) -> dict[str, Any]:
    """The model state dicts of every part this rank holds, merged: names are the model's own,
    so a stage's keys are the whole model's keys of its layers."""
    merged: dict[str, Any] = {}
    for part in state.model_parts:
        merged.update(get_model_state_dict(part))
    return merged


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


def _by_fqn(model: nn.Module, optimizer: Any, indexed: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim``-format state dict keyed by the current optimizer's parameter names."""
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[i]: value for i, value in indexed["state"].items()},
        "param_groups": [
            dict(group, params=[order[i] for i in group["params"]])
            for group in indexed["param_groups"]
        ],
    }


def _merged_model_shards(directory: Path) -> dict[str, Any]:
    """Read every rank's model shards of a DCP checkpoint into whole tensors, in this process
    and without the optimizer state: the metadata gives each tensor's shape and dtype, DCP
    fills them from whichever files hold the pieces."""
    metadata = dcp.FileSystemReader(directory / SHARDED).read_metadata()
    template: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            template[key.removeprefix("model.")] = torch.empty(
                item.size, dtype=item.properties.dtype
            )
    content = {"model": template}
    dcp.load(content, checkpoint_id=directory / SHARDED, no_dist=True)
    return content["model"]


READERS: dict[str, Callable[[Path], dict[str, Any]] | str] = {
    "consolidated": lambda directory: dict(load_file(directory / "model.pt")),
    "dcp": _merged_model_shards,
    # Engines' own formats, imported only when a checkpoint of theirs is read.
    "deepspeed": "rapidformer.accel.deepspeed_state:read_model_state",
}
"""Format name -> the function reading a checkpoint's whole model in one process."""


def read_model_state(directory: Path, format_name: str) -> dict[str, Any]:
    """The whole model state dict of the checkpoint in ``directory``, in this one process."""
    reader = READERS.get(format_name)
    if reader is None:
        raise CheckpointError(f"{directory}: unknown checkpoint format {format_name!r}")
    if isinstance(reader, str):
        module, _, function = reader.partition(":")
        reader = getattr(importlib.import_module(module), function)
    return reader(directory)
