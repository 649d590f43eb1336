"""LAMB written with torch's multi-tensor (``torch._foreach_*``) ops.

LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019) is Adam with a trust
ratio per parameter tensor: the Adam direction ``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` is
rescaled by ``||w|| / ||u||`` so that every layer moves by a similar fraction of its own norm,
whatever its gradient scale; this is what lets BERT train with very large batches.

Multi-tensor: each operation (moment updates, square roots, the two norms, the final add)
is one ``torch._foreach_*`` call over every tensor of a parameter group that shares a device
and dtype, instead of a Python loop of small kernels. The trust ratios are computed for all
tensors at once from two ``_foreach_norm`` results and never leave the device (no ``.item()``).

Options (defaults match NVIDIA apex ``FusedLAMB(adam_w_mode=True, use_nvlamb=False)``):

- ``bias_correction``: divide the moments by ``1 - beta ** step`` (paper, apex: True;
  pytorch-optimizer's ``Lamb``: no bias correction);
- ``weight_decay_mode``: ``"update"`` adds ``wd * w`` to the Adam direction, so decay enters
  the update norm and is scaled by the trust ratio (paper, apex); ``"decoupled"`` shrinks
  ``w *= 1 - lr * wd`` first and leaves decay out of the update norm (pytorch-optimizer's
  default ``weight_decouple=True``);
- ``trust_ratio`` (per group): False makes that group plain Adam(W); rapidformer turns it off
  for the biases and norm weights that are also excluded from weight decay (apex does the same
  for every group whose weight decay is 0).

The trust ratio is 1 when either norm is 0 (fresh zero-initialised tensors). Parameters
without a gradient are skipped and their step counters do not advance.

``compiled=True`` runs the same update through ``torch.compile``: inductor fuses the chain of
multi-tensor ops (about fifteen passes over every tensor) into a few kernels, after a first
step that compiles; docs/results/optimizers.md has its speed and its distance from the
multi-tensor step. rapidformer turns it on for CUDA parameters, where the fused kernels matter
most (the GPU suite times it).

Like torch's fused optimizers, ``step()`` reads two optional attributes that GradScaler and
rapidformer's stepper set: ``grad_scale`` (divide the gradients by it first) and ``found_inf``
(a 0-dim device tensor; where it is 1.0 the step moves nothing: the gradients are zeroed, the
moments keep their values through factors of exactly 1, the step counters do not advance and
the learning rate is 0). The learning rate may be a 0-dim device tensor too. Step counters live
on the parameters' device and the bias corrections are computed there: the step never reads a
device value to the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch.optim import Optimizer

WeightDecayMode = Literal["update", "decoupled"]


class Lamb(Optimizer):
    """Multi-tensor LAMB; see the module docstring for the update and the options."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        weight_decay_mode: WeightDecayMode = "update",
        trust_ratio: bool = True,
        compiled: bool = False,
    ) -> None:
        """``compiled``: run each group's update through ``torch.compile`` (inductor fuses the
        multi-tensor chain into a few kernels; the first step pays the compile)."""
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps, weight_decay must be >= 0: {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if weight_decay_mode not in ("update", "decoupled"):
            raise ValueError(f"weight_decay_mode 'update' or 'decoupled': {weight_decay_mode!r}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "weight_decay_mode": weight_decay_mode,
            "trust_ratio": trust_ratio,
        }
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True  # step() reads grad_scale and found_inf
        self.compiled = compiled
        if compiled:
            # Per group: the same list of tensors every step, so one graph each (plus one
            # more where found_inf first appears); the LR is a device tensor under rapidformer's
            # schedule, else a float that dynamo keeps symbolic.
            self._step_tensors = torch.compile(self._step_tensors, dynamic=False)  # type: ignore[method-assign]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                buckets[(param.device, param.dtype)].append(param)
            for (device, _), params in buckets.items():
                keep = None if found_inf is None else found_inf.to(device) == 0
                scale = None if grad_scale is None else grad_scale.to(device)
                self._step_tensors(group, params, keep, scale)
        return loss

    def _step_tensors(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        keep: torch.Tensor | None,
        grad_scale: torch.Tensor | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        eps, decay = group["eps"], group["weight_decay"]
        grads = [p.grad for p in params if p.grad is not None]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:  # a checkpoint loads counters on the CPU
                state["step"] = state["step"].to(p.device)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if grad_scale is not None:
            grads = list(torch._foreach_div(grads, grad_scale))
        # A skipped step: zero gradients, moment factors of exactly 1, no count, no LR.
        lr: float | torch.Tensor = group["lr"]
        if keep is not None:
            grads = [torch.where(keep, g, 0.0) for g in grads]
            beta1_now: float | torch.Tensor = torch.where(keep, beta1, 1.0)
            beta2_now: float | torch.Tensor = torch.where(keep, beta2, 1.0)
            lr = lr * keep
            torch._foreach_add_(steps, keep.float())
        else:
            beta1_now, beta2_now = beta1, beta2
            torch._foreach_add_(steps, 1.0)

        # Moments: m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2.
        torch._foreach_mul_(exp_avgs, beta1_now)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2_now)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # Adam direction u = m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) bc1 / sqrt(bc2) + eps bc1)
        # with bc = 1 - beta^step: built in place in one new buffer (memory traffic dominates).
        update = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            # All tensors' corrections at once, in float64 (as Python computes them).
            counts = torch.stack(steps).double().clamp(min=1.0)  # a skipped first step: 0
            bc1 = 1.0 - beta1**counts
            root_bc2 = (1.0 - beta2**counts).sqrt()
            torch._foreach_mul_(update, list((bc1 / root_bc2).unbind()))
            torch._foreach_add_(update, list((bc1 * eps).unbind()))
        else:
            torch._foreach_add_(update, eps)
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, exp_avgs)

        if decay != 0.0:
            if group["weight_decay_mode"] == "update":
                torch._foreach_add_(update, params, alpha=decay)
            else:
                torch._foreach_mul_(params, 1.0 - lr * decay)

        if group["trust_ratio"]:
            weight_norms = torch.stack([_full(n) for n in torch._foreach_norm(params)])
            update_norms = torch.stack([_full(n) for n in torch._foreach_norm(update)])
            ratios = torch.where(
                (weight_norms > 0) & (update_norms > 0), weight_norms / update_norms, 1.0
            )
            torch._foreach_mul_(update, list(ratios.unbind()))
        torch._foreach_mul_(update, -lr)
        torch._foreach_add_(params, update)


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A norm of a sharded DTensor parameter as a plain tensor (reduced over its shards)."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm
