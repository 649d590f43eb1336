"""The torch optimizer step: unscale, agree on overflow, clip by the global norm, step.

The default implementation of the stepper slot (:class:`rapidformer.state.Stepper`), for every
native layout:

1. fp16: the loss scaler unscales the gradients and records whether any was inf/NaN. Each rank
   checked only the gradients it holds (FSDP2 shards, and later tensor or pipeline shards), so
   the found-inf flags are summed over every rank of the job: all of them skip the step, or
   none does (otherwise the replicas and shards of one model would diverge).
2. The global gradient norm, over every shard of every parameter: DTensor gradients (FSDP2,
   tensor parallelism) give a DTensor norm whose reduction runs over the mesh axes that shard
   them; clipping scales all gradients by ``clip / norm`` when the norm is larger.
3. The optimizer step (skipped on an fp16 overflow: a fused optimizer over DTensors was seen to
   step anyway, tests/accel/test_sharding.py), the loss-scale update, and the schedule step
   (not on a skipped step, as in Megatron).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from rapidformer.distributed import process_group
from rapidformer.memory import StateBytes, expected_bytes
from rapidformer.state import StepOutcome, TrainState


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm`` (inf: never);
    returns the norm before clipping, whole on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class TorchStepper:
    """Steps ``state.optimizer``; see the module docstring."""

    name = "torch optimizer"

    def __init__(self, clip_grad: float) -> None:
        self.max_norm = clip_grad if clip_grad > 0 else float("inf")

    def step(self, state: TrainState) -> StepOutcome:
        optimizer = state.optimizer
        assert optimizer is not None, "compose() built no optimizer"
        scaler = state.grad_scaler
        skipped = False
        if scaler is not None:
            scaler.unscale_(optimizer)
            found = scaler._found_inf_per_device(optimizer).values()
            for found_inf in found:
                process_group.all_reduce_sum(found_inf, state.mesh.group("world"))
        grad_norm = clip_gradients(state.parameters, self.max_norm)
        lr = optimizer.param_groups[0]["lr"]
        if scaler is not None:
            skipped = bool(sum(scaler._found_inf_per_device(optimizer).values()))
            if not skipped:
                scaler.step(optimizer)
            scaler.update()  # halves the scale after an overflow, from the same found-inf
        else:
            optimizer.step()
        if state.lr_scheduler is not None and not skipped:
            state.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm=float(grad_norm), lr=lr, skipped=skipped)

    def expected_bytes(self, state: TrainState) -> tuple[StateBytes, StateBytes]:
        return expected_bytes(state.model, state.optimizer)
