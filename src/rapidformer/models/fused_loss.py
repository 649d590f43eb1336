"""The LM head and its cross-entropy in chunks of tokens, never all logits (``--fused-lm-loss``).

A language model's last matmul makes ``tokens x vocabulary`` logits, the largest activation of
the step (50,304 x 4,096 tokens take 0.8 GB in fp32), and the loss reads them twice. Here the
model hands its final hidden states, the head's weight and the labels to
:func:`fused_linear_cross_entropy` inside its forward (so every sharding engine has the head's
parameters gathered there). The forward computes each chunk's logits, keeps only their
log-sum-exp, and adds the chunk's loss; the backward computes each chunk's logits again and
turns them into that chunk's gradients at once. Peak memory holds one chunk's logits
(:data:`CHUNK_BYTES`), for one more head matmul in the backward.

On CUDA with Liger-Kernel installed (``rapidformer[gpu]``), Liger's fused linear cross-entropy
(Triton) runs instead; the plan says which one ran. The result is the mean over the targets
that are not ``ignore_index``, as ``F.cross_entropy`` gives it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from rapidformer.labels import IGNORE_INDEX

CHUNK_BYTES = 2**28
"""Bytes of float32 logits one chunk may hold (256 MiB: 1,334 tokens at vocabulary 50,304)."""


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over the targets of ``lse(h W^T + b) - (h W^T + b)[target]``, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        device = hidden.device.type
        # The head runs under the caller's autocast, as the plain model's head would, and so
        # does its recomputation in backward (where autocast is off by default).
        ctx.autocast = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            valid = targets[rows] != IGNORE_INDEX
            picked = logits.gather(1, targets[rows].clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse[rows] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        device = hidden.device.type
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        autocast = ctx.autocast
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows]
            with torch.autocast(
                device, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                logits = F.linear(h, weight, bias)
            # d/dlogits of the chunk's loss sum: softmax - one-hot on the valid rows, built in
            # place in the one chunk-sized buffer (a float32 copy only under autocast).
            grad = logits.float().sub_(lse[rows].unsqueeze(1)).exp_()
            valid = targets[rows] != IGNORE_INDEX
            grad.scatter_add_(
                1, targets[rows].clamp(min=0).unsqueeze(1), -torch.ones_like(grad[:, :1])
            )
            grad.mul_((valid * grad_total).unsqueeze(1))
            grad = grad.to(logits.dtype)  # what the plain head's backward would receive
            grad_hidden[rows] = (grad @ weight.to(grad.dtype)).to(hidden.dtype)
            if grad.dtype == torch.float32:  # accumulate in place: no [vocab, hidden] temporary
                grad_weight.addmm_(grad.t(), h.float())
            else:
                grad_weight += (grad.t() @ h.to(grad.dtype)).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def liger_available(device: torch.device) -> bool:
    """Liger-Kernel's fused linear cross-entropy can run here (CUDA, package installed)."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=-100)`` (the
    mean over the valid targets) without holding all logits. ``hidden`` is ``[..., H]``,
    ``targets`` the matching ``[...]``."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if liger_available(hidden.device):
        module = importlib.import_module("liger_kernel.transformers")
        loss = module.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(
            weight, hidden, targets, bias
        )
        return loss[0] if isinstance(loss, tuple) else loss
    total = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, chunk_tokens(weight.shape[0])
    )
    return total / (targets != IGNORE_INDEX).sum()


def require_labels(model: object, labels: torch.Tensor | None) -> torch.Tensor:
    """Under ``--fused-lm-loss`` a training forward must get the labels: without them it would
    return full logits and the switch would silently do nothing."""
    if labels is None:
        raise RuntimeError(
            f"--fused-lm-loss: {type(model).__name__}.forward ran in training without labels, "
            "so it would compute all logits after all; pass the labels to the model (the "
            "Pretrainer and the Finetuner's causal-LM task do), or drop --fused-lm-loss"
        )
    return labels
