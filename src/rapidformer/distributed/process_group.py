"""Process-group set-up and the few collectives several modules share."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rapidformer.config.env import LaunchEnv


def pick_device(env: LaunchEnv) -> torch.device:
    """cuda:LOCAL_RANK when a GPU is present, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: LaunchEnv, device: torch.device, *, always: bool = False) -> bool:
    """Join the job's process group (nccl on GPUs, gloo on CPUs) when there is more than one
    rank, or ``always`` (a one-rank group, for engines that need one); returns whether this call
    created it. The launcher's env:// variables say where the rendezvous is."""
    if dist.is_initialized() or (env.world_size == 1 and not always):
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # Not launched by torchrun: a group of one needs no rendezvous, an in-memory store.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return True
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
    return True


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over every rank in place (a no-op on one process) and return it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(value: int) -> int:
    """The largest ``value`` over every rank (``value`` itself on one process)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def sum_over_ranks(
    outputs: Sequence[Mapping[str, Any]], key: str, device: torch.device | None, size: int = 1
) -> torch.Tensor:
    """``key`` (a scalar, or a vector of ``size``) summed over this rank's outputs, then over
    every rank. Every rank must call it, also one that evaluated nothing (it adds zeros):
    metrics built from such sums count each sample once, however the samples were sharded."""
    total = torch.zeros(size, dtype=torch.float64, device=device)
    for output in outputs:
        total += torch.as_tensor(output[key], dtype=torch.float64, device=device).reshape(-1)
    return all_reduce_sum(total)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1
