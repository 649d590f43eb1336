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

from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.state import PlanStep, TrainState


def apply_data_parallel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    dp = mesh.dims.dp
    others = (
        isinstance(state.model, FSDPModule)
        or state.forward_backward.reduces_gradients
        or config.memory.zero_backend == "deepspeed"
    )
    if dp == 1 or others:
        return state
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    state.model = DistributedDataParallel(
        state.model, device_ids=device_ids, process_group=mesh.group("dp")
    )
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    state.plan.append(
        PlanStep("data parallel", "torch DistributedDataParallel", f"{dp} ranks, {backend}")
    )
    return state
