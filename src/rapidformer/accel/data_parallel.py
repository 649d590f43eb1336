"""Data parallelism: every rank holds the whole model and sees different samples.

``DistributedDataParallel`` over the mesh's data-parallel group all-reduces gradients in
buckets while backward still runs, so communication hides behind computation. During gradient
accumulation only the step's last micro-batch's backward all-reduces (the forward-backward slot
toggles ``require_backward_grad_sync``, what ``no_sync()`` does): gradients pile up locally and
cross the network once per optimizer step. Parameters are broadcast from the group's first rank
when wrapping, so every replica starts from the same weights whatever its seed.

The gradients are views into DDP's buckets (``gradient_as_bucket_view``): otherwise DDP keeps
the buckets as a second, flattened copy of every gradient (under accumulation both copies are
alive through the backward: 4 bytes a parameter per rank, 4.9 GiB at GPT-1.3B). The views must
exist before the first backward and survive every step: a gradient that is None when a backward
starts is allocated afresh by autograd and only copied into its bucket when DDP's hook runs,
and under accumulation (whose first micro-batches skip the hook) the whole fresh set lives
beside the buckets. So every gradient starts as zeros that DDP moves into its bucket when it
wraps the model, and the step zeroes them in place (``state.gradient_sync.in_buckets``) instead of
setting them to None.

DDP steps aside where something else reduces the gradients: FSDP2 (ZeRO-2/3), a
forward-backward slot that averages them itself (ONNX Runtime), and the DeepSpeed backend,
whose engine takes the model after the optimizer is built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import local_part
from rapidformer.loaded import instance_of
from rapidformer.state import GradientSync, PlanStep, TrainState


def apply_data_parallel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """DDP where it can reduce the gradients, else the averaging the stepper must do: the
    train state's ``gradient_sync``, written here only."""
    dp = mesh.dims.dp
    averaged_by = state.forward_backward.averaged_by
    sharded = any(
        instance_of(part, "torch.distributed.fsdp", "FSDPModule") for part in state.model_parts
    )
    if dp == 1 or averaged_by == "self":
        return state
    if sharded:  # FSDP2 reduce-scatters the dense gradients; experts may be left to us
        state.gradient_sync = _expert_sync(state)
        return state
    if averaged_by == "stepper" or mesh.dims.tp > 1 or mesh.dims.ep > 1:
        return _averaged_gradients(state, mesh)
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    for parameter in state.model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)  # DDP replaces it by its bucket's view
    state.model = DistributedDataParallel(
        state.model,
        device_ids=device_ids,
        process_group=mesh.group("dp"),
        gradient_as_bucket_view=True,
    )
    state.gradient_sync = GradientSync(in_buckets=True)
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    state.plan.append(
        PlanStep(
            "data parallel",
            "torch DistributedDataParallel",
            f"{dp} ranks, {backend}, gradients as views of its buckets",
        )
    )
    return state


def _expert_sync(state: TrainState, average_group: Any = None) -> GradientSync:
    """The expert-parallel part of the step's averaging: expert gradients (ids as the modules
    hold them now) averaged over the ranks holding the same experts, unless FSDP2 shards the
    experts and does it, then divided by the ep degree."""
    experts = state.experts
    if experts is None:
        return GradientSync(average_group=average_group)
    by_fsdp = any(
        instance_of(module, "torch.distributed.fsdp", "FSDPModule") for module in experts.modules
    )
    return GradientSync(
        average_group=average_group,
        expert_ids=experts.parameter_ids(),
        expert_group=None if by_fsdp else experts.group,
        expert_divisor=experts.degree,
    )


def _averaged_gradients(state: TrainState, mesh: ParallelMesh) -> TrainState:
    """Data parallelism of tensor-parallel or pipelined models: DDP takes neither DTensor
    parameters nor a schedule that interleaves several micro-batches' forwards, so the stepper
    averages the local gradients over dp once per step (flat buckets, after the last backward:
    the same traffic as DDP under accumulation, without overlapping it with the backward).
    The replicas start equal: every rank initialised its shard from the same seed, and the
    first data-parallel rank's values are broadcast anyway (a user's own init may differ)."""
    group = mesh.group("dp")
    sync = _expert_sync(state, average_group=group)
    experts = sync.expert_ids  # expert parallelism: replicas only over edp
    with torch.no_grad():
        dense = [local_part(p) for p in state.parameters if id(p) not in experts]
        process_group.broadcast_in_place(dense, group)
        held = [local_part(p) for p in state.parameters if id(p) in experts]
        process_group.broadcast_in_place(held, sync.expert_group)
    state.gradient_sync = sync
    state.plan.append(
        PlanStep(
            "data parallel",
            "rapidformer gradient averaging",
            f"{mesh.dims.dp} ranks; local gradients averaged over dp in flat buckets once "
            "per step (DDP takes no DTensor parameters or pipeline stages, and would average "
            "the different experts of expert-parallel ranks)"
            + ("; expert gradients summed over edp / dp" if experts else ""),
        )
    )
    return state
