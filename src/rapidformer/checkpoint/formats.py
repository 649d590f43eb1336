"""The native checkpoint formats: consolidated files, or torch.distributed.checkpoint shards.

A run's format is chosen by what it holds (:func:`native_format`):

* :class:`ConsolidatedFormat` (``model.pt``, ``optimizer.pt``): when every parameter is a plain
  tensor and the model is one module, whole on every rank (one process, DDP, ZeRO-1/OSS). Rank
  0 writes the whole state dicts, ready to export; a ZeroRedundancyOptimizer first gathers its
  partitions there. The optimizer file names its numbered parameters (``param_names``), so
  another layout can read it.
* :class:`DistributedFormat` (``sharded/``, torch.distributed.checkpoint): whenever any
  parameter is a DTensor (FSDP2 for ZeRO-2/3, tensor parallelism) or ranks hold different parts
  (pipeline stages). Each rank writes the shards it holds under names that do not depend on the
  layout (the model's own state-dict keys), and DCP reshards on load: a checkpoint resumes on
  any number of ranks and any native layout.

Either kind loads into any native run: a consolidated file into FSDP2 (each rank keeps its shard
of each whole tensor), shards into one process. The DeepSpeed backend brings its own format
(:mod:`rapidformer.accel.deepspeed.state`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import is_dtensor
from rapidformer.errors import CheckpointError
from rapidformer.loaded import instance_of
from rapidformer.safe_load import dcp_load_planner, dcp_reader, load_torch_file
from rapidformer.state import CheckpointFormat, TrainState

SHARDED = "sharded"
"""Sub-directory of a checkpoint holding torch.distributed.checkpoint (DCP) shard files."""
NATIVE = ("consolidated", "dcp")

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def _has_dtensors(state: TrainState) -> bool:
    return any(is_dtensor(p) for p in state.parameters)


def _single_part(state: TrainState) -> nn.Module:
    """The module holding every parameter this rank's optimizer steps, under the model's own
    names: the one part, or a view merging a pipeline rank's stages (their blocks into one
    ``blocks`` dict, each stage's other modules beside them)."""
    parts = state.model_parts
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            existing = view._modules.get(name)
            if isinstance(child, nn.ModuleDict):
                if existing is None:
                    view.add_module(name, nn.ModuleDict())
                merged = view._modules[name]
                assert isinstance(merged, nn.ModuleDict)
                merged.update(dict(child.items()))
            elif existing is None:
                view.add_module(name, child)
            elif existing is not child:
                raise CheckpointError(f"two pipeline stages of this rank both hold {name!r}")
    return view


def _flat() -> StateDictOptions:
    """Optimizer state keyed per parameter name ("state.<name>.exp_avg",
    "param_groups.<name>.lr"): layout-independent, so any layout (other groups, other stages
    per rank) reads it back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


class ConsolidatedFormat:
    """``model.pt`` / ``optimizer.pt``, whole, written by rank 0."""

    name = "consolidated"

    def save(self, state: TrainState, directory: Path) -> None:

        for name, content in self.files(state).items():
            torch.save(content, directory / name)

    def files(self, state: TrainState) -> dict[str, Any]:
        """What rank 0 writes (nothing on the other ranks; every rank must call it: ZeRO-1's
        optimizer state is gathered), by file name; the tensors are the live ones."""
        model_state = saved_part(state, state.unwrapped_model.state_dict())  # whole, every rank
        optimizer_state = _full_optimizer_state(state)  # ZeRO-1 gathers: every rank calls
        if optimizer_state is not None and state.optimizer is not None:
            # The name of each numbered parameter: another layout groups them differently.
            names = {id(p): n for n, p in state.unwrapped_model.named_parameters()}
            optimizer_state["param_names"] = [
                names[id(p)] for g in state.optimizer.param_groups for p in g["params"]
            ]
        if process_group.rank() != 0:
            return {}
        files = {"model.pt": model_state}
        if optimizer_state is not None:
            files["optimizer.pt"] = optimizer_state
        return files

    def record(self, state: TrainState) -> dict[str, Any]:
        return {}

    def required_files(self, state: TrainState) -> list[str]:
        return ["model.pt"]

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model_state = load_torch_file(directory / "model.pt")
        if _has_dtensors(state) or not state.forward_backward.holds_whole_model:
            # Every rank reads the whole file and keeps what it holds: its shard of each
            # tensor, its stages' tensors.
            model = _single_part(state)
            held = set(saved_part(state, model.state_dict()))
            options = StateDictOptions(full_state_dict=True, strict=state.frozen_base is None)
            if state.frozen_base is not None:
                _check_trained_present(state, model_state, directory)
            mine = {k: v for k, v in model_state.items() if k in held}
            set_model_state_dict(model, mine, options=options)
            if state.optimizer is not None:
                saved = load_torch_file(directory / "optimizer.pt")
                named = _by_fqn(model, state.optimizer, saved)
                set_optimizer_state_dict(model, state.optimizer, named, options=options)
            return
        if state.frozen_base is None:
            state.unwrapped_model.load_state_dict(model_state)
        else:  # adapters: the base is the run's own (checked by its fingerprint)
            _load_trained_part(state, model_state, directory)
        if state.optimizer is not None:  # ZeroRedundancyOptimizer takes the whole too
            saved = load_torch_file(directory / "optimizer.pt")
            saved.pop("param_names", None)
            state.optimizer.load_state_dict(saved)

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:

        return state.unwrapped_model.state_dict() if process_group.rank() == 0 else None


class DistributedFormat:
    """torch.distributed.checkpoint: each rank writes its shards, rank 0 the metadata that
    lets any number of ranks read them back (resharding on load)."""

    name = "dcp"

    def save(self, state: TrainState, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.content(state), checkpoint_id=directory / SHARDED)

    def content(self, state: TrainState) -> dict[str, Any]:
        """What DCP writes: this rank's shards of the model and optimizer state (the live
        tensors)."""
        content: dict[str, Any] = {"model": _model_state(state)}
        if state.optimizer is not None:
            content["optimizer"] = _optimizer_state(state)
        return content

    def record(self, state: TrainState) -> dict[str, Any]:
        return {}

    def required_files(self, state: TrainState) -> list[str]:
        return [f"{SHARDED}/.metadata"]  # what lets any layout read the shards back

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if instance_of(state.optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer"):
            raise CheckpointError(
                f"{directory} is a sharded (DCP) checkpoint; ZeRO-1/OSS cannot read its "
                "optimizer shards: resume with an SDP/FSDP/ZeRO-2/3 flag or plain DDP, or "
                "export it first"
            )
        # The templates say which tensors to read and how this rank holds them; a fresh
        # optimizer gets (zero) state first so that its template has the moments to fill.
        templates = [saved_part(state, get_model_state_dict(part)) for part in state.model_parts]
        content: dict[str, Any] = {"model": {k: v for t in templates for k, v in t.items()}}
        if state.optimizer is not None:
            content["optimizer"] = _optimizer_state(state)
        # Its metadata through the allowlist, its non-tensor items as plain values.
        reader, planner = dcp_reader(directory / SHARDED), dcp_load_planner()
        dcp.load(content, storage_reader=reader, planner=planner)
        strict = StateDictOptions(strict=state.frozen_base is None)
        for part, template in zip(state.model_parts, templates, strict=True):
            values = {name: content["model"][name] for name in template}
            set_model_state_dict(part, values, options=strict)
        if state.optimizer is not None:
            set_optimizer_state_dict(
                _single_part(state), state.optimizer, content["optimizer"], options=_flat()
            )

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = {}
        for part in state.model_parts:
            full.update(get_model_state_dict(part, options=options))
        return full if process_group.rank() == 0 else None


def _optimizer_state(state: TrainState) -> dict[str, Any]:
    """The optimizer's state dict as DCP reads and writes it. An optimizer that has not stepped
    yet gets zero moments first (torch steps it once with zero gradients and lr 0), so that a
    resume has tensors to fill; torch does that only while no gradient exists, and DDP's
    gradients exist from the wrap on (views of its buckets). They are set aside for it and put
    back (the same tensors, so they stay views)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = state.optimizer
    assert optimizer is not None
    if optimizer.state:
        return get_optimizer_state_dict(_single_part(state), optimizer, options=_flat())
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [p.grad for p in parameters]
    for parameter in parameters:
        parameter.grad = None
    try:
        return get_optimizer_state_dict(_single_part(state), optimizer, options=_flat())
    finally:
        for parameter, grad in zip(parameters, kept, strict=True):
            parameter.grad = grad


def native_format(state: TrainState) -> CheckpointFormat:
    """The native format for what this run holds (see the module docstring)."""
    whole = state.forward_backward.holds_whole_model and len(state.model_parts) == 1
    if _has_dtensors(state) or not whole:
        return DistributedFormat()
    return ConsolidatedFormat()


NATIVE_FORMATS: dict[str, CheckpointFormat] = {
    "consolidated": ConsolidatedFormat(),
    "dcp": DistributedFormat(),
}


def _model_state(state: TrainState) -> dict[str, Any]:
    """The model state dicts of every part this rank holds, merged: names are the model's own,
    so a stage's keys are the whole model's keys of its layers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    merged: dict[str, Any] = {}
    for part in state.model_parts:
        merged.update(saved_part(state, get_model_state_dict(part)))
    return merged


def saved_part(state: TrainState, model_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds of a model state dict: all of it, or with adapters on a
    frozen base only the parameters that train (the base is recorded by its fingerprint)."""
    base = state.frozen_base
    if base is None:
        return model_state
    return {k: v for k, v in model_state.items() if k in base.trainable}


def _check_trained_present(state: TrainState, saved: dict[str, Any], directory: Path) -> None:
    assert state.frozen_base is not None
    missing = sorted(state.frozen_base.trainable - set(saved))
    if missing:
        raise CheckpointError(
            f"{directory} lacks {len(missing)} of this run's trained parameters ({missing[0]} "
            "...): it was saved with other adapters or targets"
        )


def _load_trained_part(state: TrainState, saved: dict[str, Any], directory: Path) -> None:
    _check_trained_present(state, saved, directory)
    state.unwrapped_model.load_state_dict(saved, strict=False)


def _full_optimizer_state(state: TrainState) -> dict[str, Any] | None:
    """The whole optimizer state dict, in ``torch.optim`` format (parameters numbered in
    group order), on rank 0; None elsewhere under ZeRO-1."""
    optimizer = state.optimizer
    if optimizer is None:
        return None
    if instance_of(optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer"):
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        return optimizer.state_dict() if process_group.rank() == 0 else None
    return optimizer.state_dict()


def _by_fqn(model: nn.Module, optimizer: Any, indexed: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim``-format state dict keyed by parameter names, for the parameters
    ``model`` holds, grouped as the current optimizer groups them, each group with the saved
    hyper-parameters (the learning rate of the step it was saved at). The file's
    ``param_names`` name its numbered parameters (any layout); without them the current
    optimizer's order is assumed (a file of the same layout)."""
    names = {id(param): name for name, param in model.named_parameters()}
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    order = indexed.get("param_names") or [name for group in current for name in group]
    saved_group = {order[i]: group for group in indexed["param_groups"] for i in group["params"]}
    groups = []
    for group_names in current:
        hyper = saved_group.get(group_names[0], {}) if group_names else {}
        groups.append(dict(hyper, params=group_names))
    return {
        "state": {order[i]: v for i, v in indexed["state"].items() if order[i] in names.values()},
        "param_groups": groups,
    }


def _merged_model_shards(directory: Path) -> dict[str, Any]:
    """Read every rank's model shards of a DCP checkpoint into whole tensors, in this process
    and without the optimizer state: the metadata gives each tensor's shape and dtype, DCP
    fills them from whichever files hold the pieces."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp_reader(directory / SHARDED).read_metadata()
    template: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            template[key.removeprefix("model.")] = torch.empty(
                item.size, dtype=item.properties.dtype
            )
    content = {"model": template}
    reader, planner = dcp_reader(directory / SHARDED), dcp_load_planner()
    dcp.load(content, storage_reader=reader, planner=planner, no_dist=True)
    return content["model"]


READERS: dict[str, Callable[[Path], dict[str, Any]] | str] = {
    "consolidated": lambda directory: dict(load_torch_file(directory / "model.pt")),
    "dcp": _merged_model_shards,
    # Engines' own formats, imported only when a checkpoint of theirs is read.
    "deepspeed": "rapidformer.accel.deepspeed.state:read_model_state",
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


def format_of(state: TrainState) -> CheckpointFormat:
    """The format this run writes."""
    return state.checkpoint_format or native_format(state)


def saved_format(path: Path, record: dict[str, Any]) -> str:
    """The format a checkpoint was written in (older checkpoints did not record it)."""
    name = record.get("format")
    if isinstance(name, str):
        return name
    return "dcp" if (path / SHARDED).is_dir() else "consolidated"
