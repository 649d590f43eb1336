"""A step's gradients made ready for the update: given their parameters' placements,
averaged where no wrapper did it, unscaled, and clipped by one global norm over every shard.

The default stepper (:mod:`rapidformer.step.optimizer_step`) calls these in that order; a
pipeline's tied-weight sum uses :func:`align_gradients` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import is_dtensor, local_part
from rapidformer.state import GradientSync
from rapidformer.step.scaler_state import inverse_scale, record_unscaled

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def average_gradients(parameters: list[torch.nn.Parameter], sync: GradientSync) -> None:
    """What the data-parallel wrapper left to the step: dense local gradients averaged over
    ``sync.average_group`` (tensor-parallel or pipelined data parallelism), expert-parallel
    ones averaged over the ranks holding the same experts and divided by the ep degree (each
    already holds the contributions of the whole ep group's tokens)."""
    experts = sync.expert_ids
    if sync.average_group is not None:
        dense = [
            local_part(p.grad) for p in parameters if p.grad is not None and id(p) not in experts
        ]
        process_group.average_in_buckets(dense, sync.average_group)
    if not experts:
        return
    held = [local_part(p.grad) for p in parameters if p.grad is not None and id(p) in experts]
    if held:
        process_group.average_in_buckets(held, sync.expert_group)
        torch._foreach_mul_(held, 1.0 / sync.expert_divisor)


def align_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements. DTensor's embedding backward
    returns a vocab-parallel embedding's gradient replicated (whole on every tensor-parallel
    rank); kept that way it would cost tp times the memory and not line up with the shard a
    pipeline's tied LM head copy holds."""
    for param in parameters:
        grad = param.grad
        if is_dtensor(grad) and is_dtensor(param) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)``, also where DTensor and plain gradients mix (tensor
    parallelism: replicated LayerNorms beside sharded matrices), which the scaler's kernel
    refuses: the local values are unscaled and checked here, and the scaler is told the
    result as if it had done it."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not any(is_dtensor(g) for g in grads):
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
    sharded = [g for g in counted if is_dtensor(g)]
    plain = [g for g in counted if not is_dtensor(g)]
    if not sharded and pp_group is None and plain:  # one norm, no reductions: the common case
        norm = torch.nn.utils.get_total_norm(plain, 2.0).float()
        _scale_by_norm(grads, max_norm, norm)
        return norm
    squares = torch.zeros((), device=grads[0].device)
    if sharded:  # DTensor norms of different meshes do not mix: one norm per mesh
        for mesh_grads in _by_mesh(sharded):
            norm = torch.nn.utils.get_total_norm(mesh_grads, 2.0)
            squares = squares + cast("DTensor", norm).full_tensor().float() ** 2
    if plain:
        squares = squares + torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2
    if pp_group is not None:
        squares = process_group.all_reduce_sum(squares, pp_group)
    norm = squares.sqrt()
    _scale_by_norm(grads, max_norm, norm)
    return norm


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
