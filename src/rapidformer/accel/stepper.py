"""The torch optimizer step: unscale, agree on overflow, clip by the global norm, step.

The default implementation of the stepper slot (:class:`rapidformer.state.Stepper`), for every
native layout:

1. fp16: the loss scaler unscales the gradients and records whether any was inf/NaN. Each rank
   checked only the gradients it holds (FSDP2 shards, and later tensor or pipeline shards), so
   the found-inf flags are summed over every rank of the job: all of them skip the step, or
   none does (otherwise the replicas and shards of one model would diverge).
2. The global gradient norm, over every shard of every parameter: DTensor gradients (FSDP2,
   tensor parallelism) give a DTensor norm whose reduction runs over the mesh axes that shard
   them, plain gradients count once, pipeline stages sum their squares; clipping scales all
   gradients by ``clip / norm`` when the norm is larger.
3. The step guard's decision (:mod:`rapidformer.reliability.guard`): every rank agrees to skip
   a step with a non-finite loss or gradient anywhere (or an fp16 overflow), and to stop after a
   stop signal. The skip stays a device tensor.
4. The optimizer step with that tensor as its ``found_inf`` (:mod:`rapidformer.accel.skipping`):
   a skipped step moves no parameter or optimizer state, and the schedule counts only applied
   steps, on the device; then the loss-scale update (which halves the scale after an overflow,
   also on the device). Where the optimizer or the schedule cannot take a device decision, the
   stepper reads it to the host once and skips on the host, as the plan says.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rapidformer.accel.scaler_state import found_inf_flags, inverse_scale, record_unscaled
from rapidformer.accel.skipping import plan_decision, skipping_when
from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part
from rapidformer.memory import StateBytes, expected_bytes
from rapidformer.state import PlanStep, StepOutcome, TrainState


def clip_gradients(
    parameters: list[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    skip: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm`` (inf: never);
    returns the norm before clipping, whole on every rank.

    The norm covers every shard of every parameter exactly once: DTensor gradients (tensor
    parallelism, FSDP2) reduce their squares over the mesh axes that shard them, plain ones
    (replicated on those axes) count once; ``pp_group`` sums the stages' squares; ``skip``
    holds the ids of parameters whose gradient another stage already counts (a pipeline's
    copy of a tied weight)."""
    counted = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = [g for g in counted if isinstance(g, DTensor)]
    plain = [g for g in counted if not isinstance(g, DTensor)]
    if not sharded and pp_group is None and plain:  # one norm, no reductions: the common case
        norm = torch.nn.utils.get_total_norm(plain, 2.0).float()
        _scale_by_norm(grads, max_norm, norm)
        return norm
    squares = torch.zeros((), device=grads[0].device)
    if sharded:  # DTensor norms of different meshes do not mix: one norm per mesh
        for mesh_grads in _by_mesh(sharded):
            norm = torch.nn.utils.get_total_norm(mesh_grads, 2.0)
            squares = squares + cast(DTensor, norm).full_tensor().float() ** 2
    if plain:
        squares = squares + torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2
    if pp_group is not None:
        squares = process_group.all_reduce_sum(squares, pp_group)
    norm = squares.sqrt()
    _scale_by_norm(grads, max_norm, norm)
    return norm


def unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)``, also where DTensor and plain gradients mix (tensor
    parallelism: replicated LayerNorms beside sharded matrices), which the scaler's kernel
    refuses: the local values are unscaled and checked here, and the scaler is told the
    result as if it had done it."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        scaler.unscale_(optimizer)
        return
    locals_ = [local_part(g) for g in grads]
    inverse = inverse_scale(scaler)
    found: dict[torch.device, torch.Tensor] = {}
    for same in _by_device(locals_):
        device = same[0].device
        found[device] = torch.zeros((), device=device)
        for dtype in {t.dtype for t in same}:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [t for t in same if t.dtype == dtype], found[device], inverse.to(device)
            )
    record_unscaled(scaler, optimizer, found)


def align_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements. DTensor's embedding backward
    returns a vocab-parallel embedding's gradient replicated (whole on every tensor-parallel
    rank); kept that way it would cost tp times the memory and not line up with the shard a
    pipeline's tied LM head copy holds."""
    for param in parameters:
        grad = param.grad
        if (
            isinstance(grad, DTensor)
            and isinstance(param, DTensor)
            and grad.placements != param.placements
        ):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _reduce_expert_gradients(state: TrainState, parameters: list[torch.nn.Parameter]) -> None:
    """Expert-parallel gradients already hold the whole ep group's tokens: sum them over the
    ranks holding the same experts and divide by dp (= average over those, / ep)."""
    grads = [
        local_part(p.grad)
        for p in parameters
        if p.grad is not None and id(p) in state.expert_gradient_ids
    ]
    if not grads:
        return
    process_group.average_in_buckets(grads, state.expert_average_group)
    torch._foreach_mul_(grads, 1.0 / state.expert_parallel_size)


def _by_mesh(grads: list[DTensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    meshes: dict[int, object] = {}
    for grad in grads:
        key = next((k for k, m in meshes.items() if m == grad.device_mesh), len(meshes))
        meshes.setdefault(key, grad.device_mesh)
        groups.setdefault(key, []).append(grad)
    return list(groups.values())


def _scale_by_norm(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """``grads *= min(1, max_norm / norm)``, on each tensor's local values (no sync)."""
    if max_norm == float("inf"):
        return
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    locals_ = [local_part(g) for g in grads]
    for device_grads in _by_device(locals_):
        torch._foreach_mul_(device_grads, factor.to(device_grads[0].device))


def _by_device(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device, []).append(grad)
    return list(groups.values())


class TorchStepper:
    """Steps ``state.optimizer``; see the module docstring."""

    name = "torch optimizer"

    def __init__(self, clip_grad: float) -> None:
        self.max_norm = clip_grad if clip_grad > 0 else float("inf")
        self.on_device = False
        """Whether a skip is decided on the device (set by :meth:`prepare`)."""

    def prepare(self, state: TrainState) -> PlanStep | None:
        """Choose, once the optimizer and schedule exist, where a skip is decided."""
        assert state.optimizer is not None, "compose() built no optimizer"
        self.on_device, line = plan_decision(state.optimizer, state.lr_scheduler, state.device)
        return line

    def step(self, state: TrainState) -> StepOutcome:
        optimizer = state.optimizer
        assert optimizer is not None, "compose() built no optimizer"
        scaler = state.grad_scaler
        parameters = state.parameters
        align_gradients(parameters)
        experts = state.expert_gradient_ids
        if state.gradient_average_group is not None:
            dense = [p for p in parameters if p.grad is not None and id(p) not in experts]
            grads = [local_part(p.grad) for p in dense if p.grad is not None]
            process_group.average_in_buckets(grads, state.gradient_average_group)
        if experts:
            _reduce_expert_gradients(state, parameters)
        found_inf = None
        if scaler is not None:
            unscale(scaler, optimizer)
            flags = found_inf_flags(scaler, optimizer)
            for flag in flags:  # summed over every rank: all of them skip, or none does
                process_group.all_reduce_sum(flag, state.mesh.group("world"))
            found_inf = torch.stack([f.to(state.device) for f in flags]).sum()
        grad_norm = clip_gradients(
            parameters,
            self.max_norm,
            state.mesh.group("pp"),
            state.forward_backward.norm_skips(state),
        )
        lr = optimizer.param_groups[0]["lr"]  # the tensor this step reads (the schedule
        # writes new ones after it)
        guard = state.step_guard
        assert guard is not None, "the engine sets the step guard"
        decision = guard.decide(grad_norm, found_inf)
        skipped: torch.Tensor | bool
        if self.on_device:
            with skipping_when(optimizer, decision.skip):
                optimizer.step()
            if state.lr_scheduler is not None:
                state.lr_scheduler.step(applied=decision.applied)  # type: ignore[call-arg]
            skipped = decision.skip
        else:
            skipped = guard.read_skip(decision)
            if not skipped:
                optimizer.step()
            if state.lr_scheduler is not None and not skipped:
                state.lr_scheduler.step()
        if scaler is not None:
            scaler.update()  # halves the scale after an overflow, from the agreed found-inf
        optimizer.zero_grad(set_to_none=not state.gradients_in_buckets)
        return StepOutcome(grad_norm=grad_norm.detach(), lr=lr, skipped=skipped, stop=decision.stop)

    def expected_bytes(self, state: TrainState) -> tuple[StateBytes, StateBytes]:
        whole = getattr(state.model_parts[0], "whole_model_reference", None)
        reference = whole() if callable(whole) and len(state.model_parts) else None
        return expected_bytes(state.unwrapped_model, state.optimizer, reference)
