"""Data parallelism: every rank holds the whole model and sees different samples.

``DistributedDataParallel`` all-reduces gradients in buckets while backward still runs, so
communication hides behind computation. During gradient accumulation the engine enters
``no_sync()`` for every micro-step but the last: gradients pile up locally and cross the
network once per optimizer step. Parameters are broadcast from rank 0 when wrapping, so every
rank starts from the same weights whatever its seed.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from rapidformer.config.schema import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.engine.state import PlanStep, TrainState


def apply_data_parallel(
    state: TrainState, config: RapidformerConfig, dims: ParallelDims
) -> TrainState:
    if dims.dp == 1 or isinstance(state.model, FSDPModule):  # FSDP2 synchronises by itself
        return state
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    state.model = DistributedDataParallel(state.model, device_ids=device_ids)
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    state.plan.append(
        PlanStep("data parallel", "torch DistributedDataParallel", f"{dims.dp} ranks, {backend}")
    )
    return state
