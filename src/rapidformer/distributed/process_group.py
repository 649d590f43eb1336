"""Process-group set-up and teardown, and the few collectives several modules share.

Every reducing collective takes the group it reduces over (from
:class:`~rapidformer.distributed.mesh.ParallelMesh`); ``None`` means "this rank alone" and the
call is a no-op, which is what a one-process run and an axis of degree 1 get.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rapidformer.config.env import LaunchEnv
from rapidformer.errors import ConfigError

Group = dist.ProcessGroup | None


def pick_device(env: LaunchEnv) -> torch.device:
    """cuda:LOCAL_RANK when a GPU is present, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    env: LaunchEnv, device: torch.device, timeout_minutes: float | None = None
) -> bool:
    """Join the job's process group (nccl on GPUs, gloo on CPUs) when there is more than one
    rank; returns whether this call created it. The launcher's env:// variables say where the
    rendezvous is; ``timeout_minutes`` bounds how long a collective waits for a peer."""
    if dist.is_initialized() or env.world_size == 1:
        return False
    timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
    try:
        dist.init_process_group(
            backend=_backend(device),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            store=attempt_store(env, timeout),
        )
    except dist.DistError as exc:  # the peers never came (or the store): say so plainly
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise ConfigError.single(
            "WORLD_SIZE",
            env.world_size,
            f"rank {env.rank} waited for the other ranks at {where} and not all of them came "
            f"({exc})",
            "start every rank with the same MASTER_ADDR and MASTER_PORT (torchrun "
            f"--nproc-per-node {env.world_size} does), or unset WORLD_SIZE to train in one process",
        ) from exc
    return True


def attempt_store(env: LaunchEnv, timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torchrun, a view of the agent's store private to this attempt. The agent keeps
    one store across restarts; the keys an attempt's device-mesh groups left there made the
    next attempt's gloo connect to the dead workers' addresses (seen with torch 2.13:
    "Gloo connectFullMesh failed ... Connection refused"). None: the launcher's env://."""
    if env.agent_store is None or env.restart_count is None:
        return None
    host, port = env.agent_store
    store = dist.TCPStore(
        host,
        port,
        env.world_size,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    return dist.PrefixStore(f"rapidformer/attempt_{env.restart_count}", store)


_broken = False


def mark_broken() -> None:
    """A peer is gone: leaving the group must not wait for it (no farewell barrier)."""
    global _broken
    _broken = True


def ensure_process_group(device: torch.device) -> None:
    """A process group exists afterwards: on one process not launched by torchrun, a group of
    one on an in-memory store (for engines that insist on a group, e.g. DeepSpeed). That group
    stays for the rest of the process: DeepSpeed caches groups it builds on it, which a later
    engine in the same process (a notebook, a test session) reuses."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" in os.environ:
        env = LaunchEnv.read()
        dist.init_process_group(_backend(device), rank=env.rank, world_size=env.world_size)
    else:
        dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)


LEAVE_WAIT_S = 30.0
"""How long a rank waits for the others to have left the group before it goes on."""
_groups_left = [0]


def destroy_process_group() -> None:
    """Leave the job's process group, once every rank is done with it, and go on once every
    rank has torn its group down. A rank still tearing down when another's process exited
    (closing its gloo connections, or rank 0's store) aborted ("terminate called without an
    active exception", exit -6) after a run that had finished and saved."""
    global _broken
    if not dist.is_initialized():
        return
    store = None
    if dist.get_world_size() > 1 and not _broken:
        dist.barrier()
        # Held past the group's end, so that the ranks can still count themselves out.
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
    retire_groups()
    dist.destroy_process_group()
    _broken = False
    _groups_left[0] += 1  # the same on every rank: each leaves the same groups
    if store is not None:
        _all_out(store, f"rapidformer/left/{_groups_left[0]}", world)


def _all_out(store: dist.Store, key: str, world: int) -> None:
    """Count this rank out under ``key``; wait (at most :data:`LEAVE_WAIT_S`) for all to be."""
    deadline = time.monotonic() + LEAVE_WAIT_S
    try:
        left = store.add(key, 1)
        while left < world and time.monotonic() < deadline:
            time.sleep(0.01)
            left = store.add(key, 0)
    except RuntimeError:  # the store went with a rank that was done: so is everyone
        return


# Groups this process has left, kept while anything else still holds them. A gloo group's
# destructor joins
# its worker threads, and a worker may still be freeing a finished collective's tensors, for
# which it takes the GIL. Dropped through the Python object, the destructor lets go of the GIL
# first; dropped by C++ (the Reducer inside a DDP model the user frees after close()), it joins
# while holding the GIL and both wait forever (seen with torch 2.13 and gloo under load, after
# ZeRO-1's broadcasts). Holding the Python objects here makes theirs the last reference.
_retired: list[dist.ProcessGroup] = []


def retire_groups() -> None:
    """Call before ``dist.destroy_process_group()``: keep the job's groups (see above)."""
    # Groups retired earlier that nothing else holds any more are freed now, through Python
    # (their workers went idle long ago); the others stay (a model of theirs is still alive).
    # sys.getrefcount(_retired[i]) counts the list's reference and the call's argument.
    held = [i for i in range(len(_retired)) if sys.getrefcount(_retired[i]) > 2]
    _retired[:] = [_retired[i] for i in held]
    _retired.extend(dist.distributed_c10d._world.pg_map)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _spans_ranks(group: Group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (a no-op for None) and return it."""
    if _spans_ranks(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(value: int, group: Group, device: torch.device) -> int:
    """The largest ``value`` over ``group`` (``value`` itself for None)."""
    if not _spans_ranks(group):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def sum_over_ranks(
    outputs: Sequence[Mapping[str, Any]],
    key: str,
    device: torch.device | None,
    group: Group,
    size: int = 1,
) -> torch.Tensor:
    """``key`` (a scalar, or a vector of ``size``) summed over this rank's outputs, then over
    ``group`` (the data-parallel ranks). Every rank must call it, also one that evaluated nothing
    (it adds zeros): metrics built from such sums count each sample once, however the samples
    were sharded."""
    total = torch.zeros(size, dtype=torch.float64, device=device)
    for output in outputs:
        total += torch.as_tensor(output[key], dtype=torch.float64, device=device).reshape(-1)
    return all_reduce_sum(total, group)


def barrier() -> None:
    """Every rank of the job waits for every other (a no-op on one process)."""
    if is_distributed():
        dist.barrier()


def world_group() -> Group:
    """The whole job's group (None on one process)."""
    return dist.group.WORLD if is_distributed() else None


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


BUCKET_BYTES = 64 * 2**20
"""Gradients are averaged in flat buckets of about this size (one all-reduce per bucket)."""


def average_in_buckets(tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Average ``tensors`` (plain, local tensors) over ``group`` in place, flattening them into
    buckets of one dtype and device so that a model's gradients take a few all-reduces, not
    one per parameter."""
    if not _spans_ranks(group):
        return
    size = dist.get_world_size(group)
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in kinds.values():
        bucket: list[torch.Tensor] = []
        filled = 0
        for index, tensor in enumerate(same_kind):
            bucket.append(tensor)
            filled += tensor.numel() * tensor.element_size()
            if filled >= BUCKET_BYTES or index == len(same_kind) - 1:
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                flat.div_(size)
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                bucket, filled = [], 0


def broadcast_in_place(tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Give every rank of ``group`` its first rank's values of ``tensors`` (plain, local)."""
    if not _spans_ranks(group):
        return
    assert group is not None
    source = dist.get_global_rank(group, 0)
    for tensor in tensors:
        dist.broadcast(tensor, src=source, group=group)
