"""Data parallelism: every rank holds the whole model and sees different samples.

``DistributedDataParallel`` over the mesh's data-parallel group all-reduces gradients in
buckets while backward still runs, so communication hides behind computation. During gradient
accumulation only the step's last micro-batch's backward all-reduces (the forward-backward slot
toggles ``require_backward_grad_sync``, what ``no_sync()`` does): gradients pile up locally and
cross the network once per optimizer step. Parameters are broadcast from the group's first rank
when wrapping, so every replica starts from the same weights whatever its seed.

DDP steps aside where something else reduces the gradients: FSDP2 (ZeRO-2/3), a
forward-backward slot that averages them itself (ONNX Runtime), and the DeepSpeed backend,
whose engine takes the model after the optimizer is built.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import local_part
from rapidformer.state import PlanStep, TrainState


def apply_data_parallel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    dp = mesh.dims.dp
    sync = state.forward_backward.gradient_sync
    sharded = any(isinstance(part, FSDPModule) for part in state.model_parts)
    if dp == 1 or sharded or sync == "self":
        return state
    if sync == "stepper" or mesh.dims.tp > 1 or mesh.dims.ep > 1:
        return _averaged_gradients(state, mesh)
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    state.model = DistributedDataParallel(
        state.model, device_ids=device_ids, process_group=mesh.group("dp")
    )
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    state.plan.append(
        PlanStep("data parallel", "torch DistributedDataParallel", f"{dp} ranks, {backend}")
    )
    return state


def _averaged_gradients(state: TrainState, mesh: ParallelMesh) -> TrainState:
    """Data parallelism of tensor-parallel or pipelined models: DDP takes neither DTensor
    parameters nor a schedule that interleaves several micro-batches' forwards, so the stepper
    averages the local gradients over dp once per step (flat buckets, after the last backward:
    the same traffic as DDP under accumulation, without overlapping it with the backward).
    The replicas start equal: every rank initialised its shard from the same seed, and the
    first data-parallel rank's values are broadcast anyway (a user's own init may differ)."""
    group = mesh.group("dp")
    experts = state.expert_gradient_ids  # expert parallelism: replicas only over edp
    with torch.no_grad():
        dense = [local_part(p) for p in state.parameters if id(p) not in experts]
        process_group.broadcast_in_place(dense, group)
        held = [local_part(p) for p in state.parameters if id(p) in experts]
        process_group.broadcast_in_place(held, state.expert_average_group)
    state.gradient_average_group = group
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
