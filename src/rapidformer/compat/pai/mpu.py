"""PAI's ``mpu`` (Megatron's model-parallel utilities), as far as a script's step uses them.

``broadcast_data(keys, data, datatype)`` sent tensor-parallel rank 0's batch to its peers; the
loaders rapidformer composes already give every tensor-parallel rank of a data-parallel replica
the same batch, so here it only selects the keys and converts them. The rank queries answer
from the mesh of the engine built last.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rapidformer.compat.pai.engine import current_engine
from rapidformer.distributed.mesh import Axis


def broadcast_data(
    keys: Sequence[str], data: Mapping[str, Any] | None, datatype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``data[key]`` as a ``datatype`` tensor on the engine's device, for each key."""
    if data is None:
        raise ValueError(
            "mpu.broadcast_data got no data: in rapidformer every rank reads its batch (call "
            "next(data_iterator) on every rank)"
        )
    missing = [key for key in keys if key not in data]
    if missing:
        raise KeyError(f"mpu.broadcast_data: the batch has no {missing} (it has {list(data)})")
    device = current_engine().device
    return {key: torch.as_tensor(data[key]).to(device=device, dtype=datatype) for key in keys}


def _rank(axis: Axis) -> int:
    group = current_engine().mesh.group(axis)
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def get_data_parallel_world_size() -> int:
    return current_engine().dims.dp


def get_data_parallel_rank() -> int:
    return _rank("dp")


def get_tensor_model_parallel_world_size() -> int:
    return current_engine().dims.tp


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return current_engine().dims.pp


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_data_parallel_group() -> Any:
    return current_engine().mesh.group("dp")
