"""The optimizer: AdamW or LAMB, fused or multi-tensor, with weight decay off biases and norms.

``--optimizers apex_adam`` is AdamW with decoupled weight decay; ``apex_lamb`` is LAMB (Adam
with a per-tensor trust ratio, see ``accel/optim/lamb.py``). NVIDIA apex's FusedAdam / FusedLAMB
run when apex is importable and the parameters are on CUDA (a user who built apex); otherwise
``torch.optim.AdamW(fused=True)`` (``foreach=True`` where no fused kernel exists for the
device or dtype) and rapidformer's multi-tensor :class:`~rapidformer.accel.optim.lamb.Lamb`
(compiled with ``torch.compile`` for CUDA parameters: a few fused kernels). The
plan names the implementation that ran. The fused AdamW kernel updates every parameter in one
pass instead of a chain of per-tensor ops; on this project's CPUs it is ~40x faster than the
default for-loop implementation.

Weight decay is not applied to biases and normalisation weights (every parameter with fewer
than two dimensions): decaying them only pulls LayerNorm gains towards zero and shifts
activations, with no regularising benefit. LAMB also leaves those tensors out of layer
adaptation (trust ratio 1), as apex does for groups without weight decay.

Sharding builds the optimizer itself around its own parameter shards: it calls
:func:`optimizer_factory` for the class and keyword arguments (what
``ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)`` takes) and
:func:`parameter_groups` for the groups.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from rapidformer.accel.optim.lamb import Lamb
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import is_dtensor
from rapidformer.errors import ConfigError
from rapidformer.state import PlanStep, TrainState


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices and embeddings decay, biases and norm weights do not (and, under LAMB, keep a
    trust ratio of 1; the ``trust_ratio`` key is dropped for other optimizers).

    Under tensor parallelism some parameters are DTensors and some (replicated LayerNorms)
    plain tensors; a fused optimizer kernel refuses to mix them, so each kind gets its own
    groups (same hyper-parameters)."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            # Stacked MoE expert biases are [experts, width]: biases all the same.
            matrix = param.ndim >= 2 and not name.endswith(("experts.b1", "experts.b2"))
            key = (matrix, is_dtensor(param))
            groups.setdefault(key, []).append(param)
    kinds = sorted({dtensor for _, dtensor in groups}) or [False]
    result = []
    for decays in (True, False):
        for dtensor in kinds:
            params = groups.get((decays, dtensor), [])
            if not params and groups:
                # An empty group breaks DCP's per-parameter optimizer state (adapters without
                # a vector to train, for one, leave the no-decay group empty).
                continue
            if decays:
                result.append({"params": params, "weight_decay": weight_decay})
            else:
                result.append({"params": params, "weight_decay": 0.0, "trust_ratio": False})
    return result


def optimizer_factory(
    config: RapidformerConfig, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[type[Optimizer], dict[str, Any], str]:
    """The optimizer ``--optimizers`` names for parameters on ``device`` of ``dtype``:
    ``(class, keyword arguments without params, implementation description)``.

    Call ``cls(parameter_groups(model, config.training.weight_decay), **kwargs)``, or hand
    ``cls`` and ``kwargs`` to a sharded optimizer as its inner optimizer.
    """
    lr = config.training.lr
    if lr is None:
        raise ConfigError.single(
            "--lr",
            None,
            "a learning rate is required to build the optimizer",
            "pass --lr, e.g. --lr 1e-4, or hand compose() an optimizer",
        )
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": config.training.weight_decay}
    apex = _apex_optimizers() if device.type == "cuda" else None
    if config.optimizer.optimizers == "apex_lamb":
        if apex is not None:
            # The engine clips gradients already; apex's own global clipping stays off.
            kwargs.update(bias_correction=True, adam_w_mode=True, max_grad_norm=float("inf"))
            return apex.FusedLAMB, kwargs, "apex.optimizers.FusedLAMB"
        if device.type == "cuda":  # a few fused kernels instead of ~15 passes over memory
            return Lamb, {**kwargs, "compiled": True}, "rapidformer Lamb (torch.compile)"
        return Lamb, kwargs, "rapidformer Lamb (torch._foreach multi-tensor)"
    if apex is not None:
        kwargs.update(adam_w_mode=True)
        return apex.FusedAdam, kwargs, "apex.optimizers.FusedAdam"
    if _fused_adamw_supported(device, dtype):
        return torch.optim.AdamW, {**kwargs, "fused": True}, "torch.optim.AdamW(fused=True)"
    return torch.optim.AdamW, {**kwargs, "foreach": True}, "torch.optim.AdamW(foreach=True)"


def build_optimizer(
    model: nn.Module, config: RapidformerConfig, device: torch.device
) -> tuple[Optimizer, str]:
    """The optimizer over ``model``'s parameter groups and its implementation description."""
    groups = parameter_groups(model, config.training.weight_decay)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cls, kwargs, implementation = optimizer_factory(config, device, dtype)
    if cls is not Lamb:
        groups = [{k: v for k, v in g.items() if k != "trust_ratio"} for g in groups]
    return cls(groups, **kwargs), implementation


def apply_optimizer(
    state: TrainState,
    config: RapidformerConfig,
    mesh: ParallelMesh,
    *,
    device: torch.device | None = None,
) -> TrainState:
    """Build the optimizer ``--optimizers`` names over the parallelised model (or the
    template's), for its states on ``device`` (default: the model's)."""
    if state.optimizer is None and state.optimizer_fn is not None:
        # Built now, over the parameters sharding and materialisation left (no rebuild).
        state.optimizer = state.optimizer_fn(state.unwrapped_model)
    if state.optimizer is not None:
        state.plan.append(PlanStep("optimizer", "user-supplied", type(state.optimizer).__name__))
        return state
    device = device or state.device
    optimizer, implementation = build_optimizer(state.unwrapped_model, config, device)
    state.optimizer = optimizer
    groups = optimizer.param_groups
    decayed = sum(p.numel() for g in groups if g["weight_decay"] for p in g["params"])
    total = sum(p.numel() for g in groups for p in g["params"])
    lamb = "; under LAMB they keep a trust ratio of 1" if isinstance(optimizer, Lamb) else ""
    state.plan.append(
        PlanStep(
            "optimizer",
            implementation,
            f"for --optimizers {config.optimizer.optimizers}; weight decay "
            f"{config.training.weight_decay} on {decayed}/{total} parameters (biases and norms "
            f"excluded{lamb})",
        )
    )
    return state


def _apex_optimizers() -> Any:
    """``apex.optimizers`` when a user has built apex with its CUDA extensions, else None."""
    try:
        return importlib.import_module("apex.optimizers")
    except ImportError:  # apex is not on the package index; most users do not have it
        return None


def _fused_adamw_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a fused AdamW kernel for this device and floating dtype (the list of
    devices is torch's own; torch itself only fails at the first step)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return dtype.is_floating_point and device.type in _get_fused_kernels_supported_devices()


FEATURE = Feature(
    "optimizer",
    flags=("--optimizers",),
    switched_on=lambda config: "apex_lamb" if config.optimizer.optimizers == "apex_lamb" else None,
    refused_on={
        "deepspeed": "DeepSpeed ZeRO flattens each parameter group into one partition per "
        "rank, so LAMB's per-tensor trust ratio would be computed per partition (not LAMB, and "
        "different for every rank count)"
    },
)
