"""Mixed precision: run matmuls in fp16 or bf16 while the weights stay fp32.

``torch.autocast`` picks the precision per op (matmuls and convolutions low, reductions and
softmax fp32), so the model code does not change. fp16 has a narrow exponent range: small
gradients underflow to zero. A dynamic loss scaler (``GradScaler``) multiplies the loss before
backward, unscales the gradients before clipping, skips any step whose gradients overflowed to
inf/NaN and halves its scale when that happens (growing it again after 2000 clean steps).
bf16 keeps fp32's exponent range and needs no scaler.

The autocast context wraps the model's ``forward``, so a hand-written loop that calls the
composed model gets it too; losses computed outside the model run in fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.models.forward_wrap import current_forward
from rapidformer.state import MixedPrecision, PlanStep, TrainState

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    forward = current_forward(module)  # weakly bound: see forward_wrap

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = autocast_forward


def apply_precision(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    precision = config.precision.autocast  # fp8: bf16 autocast around float8 linears
    if precision == "fp32":
        return state
    dtype = _DTYPES[precision]
    device_type = state.device.type
    for module in state.forward_backward.forward_modules(state):
        _autocast_forward(module, device_type, dtype)
    if precision == "fp16":
        state.precision = MixedPrecision(dtype, torch.amp.GradScaler(device_type))
        state.plan.append(
            PlanStep(
                "mixed precision",
                "torch.autocast + torch.amp.GradScaler",
                "fp16, dynamic loss scale, overflow steps skipped",
            )
        )
    else:
        state.precision = MixedPrecision(dtype)
        state.plan.append(PlanStep("mixed precision", "torch.autocast", "bf16, no loss scaling"))
    return state
