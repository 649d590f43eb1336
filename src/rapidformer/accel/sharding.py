"""Model-state sharding (ZeRO), native: each data-parallel rank keeps only part of the state.

Plain data parallelism keeps four copies' worth of model state on every rank: parameters,
gradients and (Adam) two optimizer moments, 16 bytes per parameter in fp32. ZeRO removes the
redundancy in three stages, each one a native PyTorch mechanism here:

* ``--sharding zero1`` (PAI's OSS, ``--zero-1-memory-optimization``):
  ``ZeroRedundancyOptimizer`` partitions the parameters over the ranks; each rank builds the
  optimizer (and its state) for its partition only, steps it, and broadcasts the updated
  parameters. Gradients are still all-reduced whole by DDP.
* ``--sharding zero2`` (PAI's SDP, ``--zero-2-memory-optimization``): FSDP2
  ``fully_shard(reshard_after_forward=False)``. Gradients are reduce-scattered, so each rank
  holds 1/N of them and of the optimizer state; the full parameters are gathered once for the
  forward and kept until backward ends (no second all-gather).
* ``--sharding zero3`` (PAI's FSDP, ``--zero-3-memory-optimization``): FSDP2
  ``fully_shard``: parameters are sharded too and gathered block by block, in forward and
  again in backward (1.5x DDP's communication volume for 1/N of everything).

FSDP2 units are the transformer blocks (found by their class: a Hugging Face model's
``_no_split_modules``, else the container of identical blocks) plus the root, which
owns the embeddings and head. bf16/fp16 runs compute in the low precision through
``MixedPrecisionPolicy`` (gradients reduced in fp32). ``--cpu-offload`` keeps the sharded
parameters, gradients and optimizer state in CPU memory (``CPUOffloadPolicy``); the optimizer
then steps on the CPU.

With FSDP2, gradients are reduce-scattered at every micro-step of an accumulation (see the
engine): skipping the sync would hold whole unsharded gradients through the accumulation,
which is the memory this mode exists to save.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from rapidformer.accel.optim.partitioned import PartitionedOptimizer
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.models.blocks import shard_units
from rapidformer.state import PlanStep, TrainState

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
_SHARDED = {
    "zero2": "gradients, optimizer state",
    "zero3": "parameters, gradients, optimizer state",
}
"""What FSDP2 shards in each of its stages (zero1 shards only the optimizer: ZeRO-1 below)."""


def stage_name(sharding: str) -> str:
    """``ZeRO-2`` for ``zero2``, for the plan."""
    return f"ZeRO-{sharding[-1]}"


def apply_sharding(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    """FSDP2 for ZeRO-2/3 over the data-parallel mesh (this replaces DDP); ZeRO-1 keeps DDP and
    shards the optimizer in :func:`apply_optimizer_sharding`."""
    sharding = config.memory.sharding
    if sharding != "none" and mesh.dims.dp == 1:
        unmoved = (
            ", not offloaded (--cpu-offload acts on shards)" if config.memory.cpu_offload else ""
        )
        detail = f"1 data-parallel rank: nothing to shard, model state stays whole{unmoved}"
        state.plan.append(PlanStep(f"{stage_name(sharding)} (native)", "none", detail))
        return state
    if sharding not in _SHARDED:
        return state
    # FSDP2 is imported where it is used: a run without sharding does not wait for it.
    from torch.distributed.fsdp import fully_shard

    options = _fsdp_options(config, mesh)
    names = {id(p): n for n, p in state.unwrapped_model.named_parameters()}
    units = [unit for part in state.model_parts for unit in shard_units(part)]
    unit_class = type(units[0]).__name__ if units else ""  # before FSDP2 renames it FSDP<class>
    experts_sharded = _shard_experts(state, mesh, options)
    for unit in units:
        fully_shard(unit, **options)
    for part in state.model_parts:
        fully_shard(part, **options)
    if state.optimizer is not None:  # a user's optimizer holds the replaced parameters
        new = dict(state.unwrapped_model.named_parameters())
        state.optimizer = _rebuilt(state.optimizer, names, new, config.memory.sharding)
    engine = f"FSDP2 fully_shard(reshard_after_forward={options['reshard_after_forward']})"
    detail = _describe(state, config, mesh, len(units), unit_class, experts_sharded)
    state.plan.append(PlanStep(f"{stage_name(sharding)} (native)", engine, detail))
    return state


def _fsdp_options(config: RapidformerConfig, mesh: ParallelMesh) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for this run."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    precision = config.precision.autocast
    mixed = MixedPrecisionPolicy()
    if precision in _LOW:
        mixed = MixedPrecisionPolicy(param_dtype=_LOW[precision], reduce_dtype=torch.float32)
    offload = OffloadPolicy()
    if config.memory.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return {
        "mesh": mesh.submesh("dp"),
        # Under pipeline parallelism a stage's parameters are gathered once per micro-batch
        # forward and kept for its backward (torchtitan's choice): resharding between would
        # gather them again for every micro-batch's backward.
        "reshard_after_forward": config.memory.sharding == "zero3" and mesh.dims.pp == 1,
        "mp_policy": mixed,
        "offload_policy": offload,
    }


def _describe(
    state: TrainState,
    config: RapidformerConfig,
    mesh: ParallelMesh,
    units: int,
    unit_class: str,
    experts_sharded: bool,
) -> str:
    """The plan's detail of what FSDP2 sharded and how."""
    dims, sharding, parts = mesh.dims, config.memory.sharding, len(state.model_parts)
    precision = config.precision.autocast
    details = [
        f"{_SHARDED[sharding]} sharded over {dims.dp} ranks; {units} units"
        + (f" x {unit_class}" if units else "")
        + (" + root" if parts == 1 else f" + {parts} roots")
    ]
    if experts_sharded:
        details.append(f"expert-parallel weights sharded over the {dims.dp // dims.ep} edp ranks")
    elif state.experts is not None:
        details.append("expert-parallel weights left out (one edp rank: nothing to shard)")
    if sharding == "zero3" and dims.pp > 1:
        details.append("parameters kept gathered from a micro-batch's forward to its backward (PP)")
    if precision in _LOW:
        details.append(f"MixedPrecisionPolicy {precision} compute, fp32 reduce")
    if config.memory.cpu_offload:
        details.append("CPUOffloadPolicy")
    return "; ".join(details)


def _shard_experts(state: TrainState, mesh: ParallelMesh, options: dict[str, Any]) -> bool:
    """Expert parallelism: each ep rank holds other experts, so FSDP over dp must not touch
    them. With several expert-data-parallel ranks (edp) their experts are sharded over those
    (a unit per MoE layer's experts, whose reduce-scatter averages over edp; the stepper then
    divides by ep: gloo has no pre-multiplied sum for a divide factor of dp); with one, FSDP
    leaves them out. Returns whether it sharded (FSDP2 then registered new, sharded
    parameters in the experts' modules, and averages their gradients over edp itself)."""
    from torch.distributed.fsdp import fully_shard

    if state.experts is None:
        return False
    edp_mesh = mesh.submesh("edp")
    if edp_mesh is None:
        options["ignored_params"] = {p for m in state.experts.modules for p in m.parameters()}
        return False
    for experts in state.experts.modules:
        fully_shard(experts, **{**options, "mesh": edp_mesh})
    return True


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its constructor takes (AdamW also stores derived entries such as
    decoupled_weight_decay, which it does not accept back)."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _require_fresh(optimizer: Optimizer, sharding: str) -> None:
    """Sharding rebuilds the optimizer; state it already holds could not follow."""
    if optimizer.state:
        raise ConfigError.single(
            "--sharding",
            sharding,
            "the optimizer handed to compose() has already stepped; sharding rebuilds it "
            "over the sharded parameters and its state cannot follow",
            "hand compose() a fresh optimizer (or none, to build the --optimizers one)",
        )


def _rebuilt(
    optimizer: Optimizer, names: dict[int, str], new: dict[str, nn.Parameter], sharding: str
) -> Optimizer:
    """The same optimizer class, groups and hyper-parameters over FSDP2's sharded parameters."""
    _require_fresh(optimizer, sharding)
    groups = [
        dict(group, params=[new[names[id(p)]] for p in group["params"]])
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups, **_constructor_defaults(optimizer))


def apply_optimizer_sharding(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """ZeRO-1: rebuild the optimizer as a ZeroRedundancyOptimizer of the same class, groups
    and hyper-parameters over the data-parallel group (runs after the optimizer exists)."""
    optimizer = state.optimizer
    dims = mesh.dims
    if config.memory.sharding != "zero1" or dims.dp == 1 or optimizer is None:
        return state
    _require_fresh(optimizer, "zero1")
    groups = [dict(group) for group in optimizer.param_groups]
    dp_group = mesh.group("dp")
    assert dp_group is not None
    if dims.tp > 1 or dims.pp > 1 or dims.ep > 1:
        # DTensor parameters cannot be broadcast by ZeroRedundancyOptimizer: the same
        # partitioning on local tensors (see optim/partitioned.py); experts over edp.
        experts = state.experts
        state.optimizer = PartitionedOptimizer(
            groups,
            type(optimizer),
            dp_group,
            experts.parameter_ids() if experts is not None else frozenset(),
            experts.group if experts is not None else None,
            **_constructor_defaults(optimizer),
        )
        engine = "rapidformer PartitionedOptimizer + gradient averaging"
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        state.optimizer = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=type(optimizer),
            process_group=dp_group,
            **_constructor_defaults(optimizer),
        )
        engine = "torch ZeroRedundancyOptimizer + DDP"
    state.plan.append(
        PlanStep(
            "ZeRO-1 (native)",
            engine,
            f"{type(optimizer).__name__} state sharded over {dims.dp} ranks",
        )
    )
    return state


def native_rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The native backend offloads only what FSDP2 shards (DeepSpeed's ZeRO-Offload also
    takes zero1's optimizer state)."""
    memory = config.memory
    if memory.cpu_offload and memory.sharding not in _SHARDED:  # FSDP2's CPUOffloadPolicy
        yield Violation(
            "--cpu-offload",
            True,
            "offload needs sharded model state"
            + (
                f" (--sharding {memory.sharding} keeps whole parameters on DDP)"
                if memory.sharding != "none"
                else ""
            ),
            "add --sharding zero2 or zero3 (--zero-2/3-memory-optimization)",
        )


FEATURE = Feature("sharding", flags=("--sharding", "--cpu-offload"))
