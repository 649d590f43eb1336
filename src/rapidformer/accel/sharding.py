"""Model-state sharding (ZeRO), native: each data-parallel rank keeps only part of the state.

Plain data parallelism keeps four copies' worth of model state on every rank: parameters,
gradients and (Adam) two optimizer moments, 16 bytes per parameter in fp32. ZeRO removes the
redundancy in three stages, each one a native PyTorch mechanism here:

* ZeRO-1 = OSS (``--zero-1-memory-optimization``, ``--oss-memory-optimization``):
  ``ZeroRedundancyOptimizer`` partitions the parameters over the ranks; each rank builds the
  optimizer (and its state) for its partition only, steps it, and broadcasts the updated
  parameters. Gradients are still all-reduced whole by DDP.
* ZeRO-2 = SDP (``--zero-2-memory-optimization``, ``--oss-sdp-memory-optimization``): FSDP2
  ``fully_shard(reshard_after_forward=False)``. Gradients are reduce-scattered, so each rank
  holds 1/N of them and of the optimizer state; the full parameters are gathered once for the
  forward and kept until backward ends (no second all-gather).
* ZeRO-3 = FSDP (``--zero-3-memory-optimization``, ``--fsdp-memory-optimization``): FSDP2
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
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from rapidformer.accel.checkpointing import find_blocks
from rapidformer.accel.partitioned_optimizer import PartitionedOptimizer
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.state import PlanStep, TrainState

Mode = Literal["oss", "sdp", "fsdp"]

_MODES: dict[str, tuple[Mode, str]] = {
    "--oss-memory-optimization": ("oss", "OSS"),
    "--zero-1-memory-optimization": ("oss", "ZeRO-1"),
    "--oss-sdp-memory-optimization": ("sdp", "SDP"),
    "--zero-2-memory-optimization": ("sdp", "ZeRO-2"),
    "--fsdp-memory-optimization": ("fsdp", "FSDP"),
    "--zero-3-memory-optimization": ("fsdp", "ZeRO-3"),
}
_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def sharding_mode(config: RapidformerConfig) -> tuple[Mode, str] | None:
    """(mechanism, name as the user asked for it), or None without a sharding flag."""
    flags = config.memory.sharding_flags
    return _MODES[flags[0]] if flags else None


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: a Hugging Face model's layer classes
    (``_no_split_modules``), else the repeated blocks of an ``nn.ModuleList``/``ModuleDict``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if units:
            return units
    return find_blocks(model)


def apply_sharding(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    """FSDP2 for ZeRO-2/3 over the data-parallel mesh (this replaces DDP); OSS keeps DDP and
    shards the optimizer in :func:`apply_optimizer_sharding`."""
    mode = sharding_mode(config)
    dims = mesh.dims
    if mode is not None and dims.dp == 1:
        unmoved = (
            ", not offloaded (--cpu-offload acts on shards)" if config.memory.cpu_offload else ""
        )
        detail = f"1 data-parallel rank: nothing to shard, model state stays whole{unmoved}"
        state.plan.append(PlanStep(f"{mode[1]} (native)", "none", detail))
        return state
    if mode is None or mode[0] == "oss":
        return state
    kind, name = mode
    precision = config.precision.autocast
    mixed = MixedPrecisionPolicy()
    if precision in _LOW:
        mixed = MixedPrecisionPolicy(param_dtype=_LOW[precision], reduce_dtype=torch.float32)
    offload = OffloadPolicy()
    if config.memory.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # Under pipeline parallelism a stage's parameters are gathered once per micro-batch
    # forward and kept for its backward (torchtitan's choice): resharding between would gather
    # them again for every micro-batch's backward.
    reshard = kind == "fsdp" and dims.pp == 1
    names = {id(p): n for n, p in state.unwrapped_model.named_parameters()}
    units = [unit for part in state.model_parts for unit in shard_units(part)]
    unit_class = type(units[0]).__name__ if units else ""  # before FSDP2 renames it FSDP<class>
    dp_mesh = mesh.submesh("dp")
    options: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard,
        "mp_policy": mixed,
        "offload_policy": offload,
    }
    experts_sharded = _shard_experts(state, mesh, options)
    for unit in units:
        fully_shard(unit, **options)
    for part in state.model_parts:
        fully_shard(part, **options)
    what = (
        "parameters, gradients, optimizer state" if kind == "fsdp" else "gradients, optimizer state"
    )
    detail = (
        f"{what} sharded over {dims.dp} ranks; {len(units)} units"
        + (f" x {unit_class}" if units else "")
        + (" + root" if len(state.model_parts) == 1 else f" + {len(state.model_parts)} roots")
    )
    if experts_sharded:
        detail += f"; expert-parallel weights sharded over the {dims.dp // dims.ep} edp ranks"
    elif state.expert_gradient_ids:
        detail += "; expert-parallel weights left out (one edp rank: nothing to shard)"
    if kind == "fsdp" and not reshard:
        detail += "; parameters kept gathered from a micro-batch's forward to its backward (PP)"
    if precision in _LOW:
        detail += f"; MixedPrecisionPolicy {precision} compute, fp32 reduce"
    if config.memory.cpu_offload:
        detail += "; CPUOffloadPolicy"
    if state.optimizer is not None:  # a user's optimizer holds the replaced parameters
        new = dict(state.unwrapped_model.named_parameters())
        state.optimizer = _rebuilt(state.optimizer, names, new, mode_flag(config))
    engine = f"FSDP2 fully_shard(reshard_after_forward={reshard})"
    state.plan.append(PlanStep(f"{name} (native)", engine, detail))
    return state


def _shard_experts(state: TrainState, mesh: ParallelMesh, options: dict[str, Any]) -> bool:
    """Expert parallelism: each ep rank holds other experts, so FSDP over dp must not touch
    them. With several expert-data-parallel ranks (edp) their experts are sharded over those
    (a unit per MoE layer's experts, whose reduce-scatter averages over edp; the stepper then
    divides by ep: gloo has no pre-multiplied sum for a divide factor of dp); with one, FSDP
    leaves them out. Returns whether it sharded."""
    if not state.expert_gradient_ids:
        return False
    edp_mesh = mesh.submesh("edp")
    layers = [m for part in state.model_parts for m in part.modules() if hasattr(m, "experts")]
    expert_modules = [m.experts for m in layers if isinstance(m.experts, nn.Module)]
    if edp_mesh is None:
        held = [p for part in state.model_parts for p in part.parameters()]
        options["ignored_params"] = {p for p in held if id(p) in state.expert_gradient_ids}
        return False
    for experts in expert_modules:
        fully_shard(experts, **{**options, "mesh": edp_mesh})
    # FSDP registered new (sharded) parameters; it averages them over edp itself.
    state.expert_gradient_ids = frozenset(id(p) for m in expert_modules for p in m.parameters())
    state.expert_average_group = None
    return True


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its constructor takes (AdamW also stores derived entries such as
    decoupled_weight_decay, which it does not accept back)."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def mode_flag(config: RapidformerConfig) -> str:
    return config.memory.sharding_flags[0]


def _require_fresh(optimizer: Optimizer, flag: str) -> None:
    """Sharding rebuilds the optimizer; state it already holds could not follow."""
    if optimizer.state:
        raise ConfigError.single(
            flag,
            True,
            "the optimizer handed to compose() has already stepped; sharding rebuilds it "
            "over the sharded parameters and its state cannot follow",
            "hand compose() a fresh optimizer (or none, to build the --optimizers one)",
        )


def _rebuilt(
    optimizer: Optimizer, names: dict[int, str], new: dict[str, nn.Parameter], flag: str
) -> Optimizer:
    """The same optimizer class, groups and hyper-parameters over FSDP2's sharded parameters."""
    _require_fresh(optimizer, flag)
    groups = [
        dict(group, params=[new[names[id(p)]] for p in group["params"]])
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups, **_constructor_defaults(optimizer))


def apply_optimizer_sharding(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """ZeRO-1/OSS: rebuild the optimizer as a ZeroRedundancyOptimizer of the same class,
    groups and hyper-parameters over the data-parallel group (runs after the optimizer
    exists)."""
    mode = sharding_mode(config)
    optimizer = state.optimizer
    dims = mesh.dims
    if mode is None or mode[0] != "oss" or dims.dp == 1 or optimizer is None:
        return state
    _require_fresh(optimizer, mode_flag(config))
    groups = [dict(group) for group in optimizer.param_groups]
    dp_group = mesh.group("dp")
    assert dp_group is not None
    if dims.tp > 1 or dims.pp > 1 or dims.ep > 1:
        # DTensor parameters cannot be broadcast by ZeroRedundancyOptimizer: the same
        # partitioning on local tensors (see partitioned_optimizer); experts over edp.
        state.optimizer = PartitionedOptimizer(
            groups,
            type(optimizer),
            dp_group,
            state.expert_gradient_ids,
            state.expert_average_group,
            **_constructor_defaults(optimizer),
        )
        engine = "rapidformer PartitionedOptimizer + gradient averaging"
    else:
        state.optimizer = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=type(optimizer),
            process_group=dp_group,
            **_constructor_defaults(optimizer),
        )
        engine = "torch ZeroRedundancyOptimizer + DDP"
    state.plan.append(
        PlanStep(
            f"{mode[1]} (native)",
            engine,
            f"{type(optimizer).__name__} state sharded over {dims.dp} ranks",
        )
    )
    return state


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The memory-optimisation flags, on either backend: one at a time."""
    flags = config.memory.sharding_flags
    if len(flags) > 1:
        yield Violation(
            flags[1],
            True,
            f"at most one memory-optimization flag, got {', '.join(flags)}",
            "keep one of them",
        )


def native_rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The native backend offloads only what FSDP2 shards (DeepSpeed's rules say what its
    ZeRO-Offload takes)."""
    memory = config.memory
    flags = memory.sharding_flags
    sharders = {  # FSDP2 modes: CPUOffloadPolicy (ZeRO-1/OSS keeps whole parameters on DDP)
        "--oss-sdp-memory-optimization",
        "--zero-2-memory-optimization",
        "--zero-3-memory-optimization",
        "--fsdp-memory-optimization",
    }
    if memory.cpu_offload and not sharders.intersection(flags):
        yield Violation(
            "--cpu-offload",
            True,
            "offload needs sharded model state",
            "add --zero-2-memory-optimization, --zero-3-memory-optimization or "
            "--fsdp-memory-optimization",
        )
