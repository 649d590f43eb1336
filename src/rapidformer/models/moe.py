"""A sparsely gated mixture-of-experts feed-forward layer, with expert parallelism.

:class:`MoELayer` is a drop-in ``[B, T, H] -> [B, T, H]`` replacement for a block's
:class:`~rapidformer.models.layers.FeedForward`: a router (:mod:`rapidformer.models.moe_router`)
sends every token to k of E experts, each expert is the dense FFN's shape (``fc1``, GELU,
``fc2``), and a token's output is the weighted sum of its experts' outputs. An assignment an
expert has no capacity for is dropped: that expert contributes nothing, and a token with every
assignment dropped leaves the layer as zeros (the block's residual carries it unchanged).

**Experts as stacked weights.** ``w1 [E, H, F]``, ``b1 [E, F]``, ``w2 [E, F, H]``, ``b2 [E, H]``.
The assignments are sorted by expert, so each expert's tokens are one contiguous run of rows,
and both matrix products run as one ``torch._grouped_mm`` over the runs (``offs`` = where each
run ends), where the platform has it (fp32 or bf16 with H and F multiples of 8 on CPU, bf16 on
recent GPUs); otherwise as a loop over the experts (:attr:`GroupedExperts.kernel` says which).

**Expert parallelism.** With an ``ep`` group of size P, each rank holds E / P consecutive
experts (the parameters are DTensors sharded on dim 0 over the ep mesh, so checkpoints are
layout-independent) and routes its own tokens. Each rank first tells every other how many rows
it will send to each of their experts (an ``all_to_all_single`` of counts), then the rows go with
an autograd ``all_to_all_single`` (uneven and empty splits work on gloo), are computed by their
experts, and return the same way; weighting and summing happen on the sending rank, so the
router's gradients never leave it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from rapidformer.distributed.tensors import local_part
from rapidformer.models.moe_router import (
    AuxScale,
    Balancing,
    MoERuntime,
    Router,
    RouterStats,
    Routing,
    Score,
    attach_aux_loss,
    global_balancing_loss,
    in_recompute,
    load_balancing_loss,
    route,
    z_loss,
)

Kernel = Literal["grouped_mm", "loop"]
DropPolicy = Literal["probs", "position"]


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, dims: tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands (else the per-expert loop)."""
    if not hasattr(torch, "_grouped_mm") or any(d % 8 for d in dims):
        return False
    if device.type == "cpu":
        # Under torch.compile the operator's shape function accepts bf16 only.
        compiling = torch.compiler.is_compiling()
        return dtype == torch.bfloat16 or (dtype == torch.float32 and not compiling)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    refuses the stride-0 gradient of e.g. ``out.sum()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x)


class GroupedExperts(nn.Module):
    """E experts of shape ``H -> F -> H`` as stacked weights; see the module docstring."""

    def __init__(
        self, num_experts: int, hidden_size: int, ffn_hidden_size: int, approximate: str
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.approximate = approximate
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.force_loop = False
        """Use the per-expert loop even where grouped_mm runs (benchmarks, tests)."""

    def kernel(self, dtype: torch.dtype, device: torch.device) -> Kernel:
        dims = (self.w1.shape[1], self.w1.shape[2])
        ok = not self.force_loop and grouped_mm_supported(dtype, device, dims)
        return "grouped_mm" if ok else "loop"

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by local expert, ``counts[e]`` rows for expert e."""
        w1, b1, w2, b2 = (local_part(p) for p in (self.w1, self.b1, self.w2, self.b2))
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled() else x.dtype
        w1, b1, w2, b2, x = (t.to(dtype) for t in (w1, b1, w2, b2, x))
        expert_of_row = torch.repeat_interleave(
            torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0]
        )
        with torch.autocast(x.device.type, enabled=False):
            if self.kernel(dtype, x.device) == "grouped_mm":
                ends = counts.cumsum(0).to(torch.int32)
                h = _contiguous_grad(torch._grouped_mm(x, w1, offs=ends)) + b1[expert_of_row]
                h = F.gelu(h, approximate=self.approximate)
                y = _contiguous_grad(torch._grouped_mm(h.contiguous(), w2, offs=ends))
                return y + b2[expert_of_row]
            out = []
            for expert, rows in enumerate(x.split(counts.tolist())):
                h = F.gelu(rows @ w1[expert] + b1[expert], approximate=self.approximate)
                out.append(h @ w2[expert] + b2[expert])
            return torch.cat(out) if out else x.new_zeros(0, w2.shape[-1])


class MoELayer(nn.Module):
    """Router + experts in a block's FFN slot; see the module docstring."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        *,
        topk: int = 2,
        approximate: str = "tanh",
        capacity_factor: float | None = None,
        drop_policy: DropPolicy = "probs",
        balancing: Balancing = "aux_loss",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float | None = None,
        score: Score = "softmax",
    ) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk {topk} must lie in [1, num_experts {num_experts}]")
        self.num_experts = num_experts
        self.topk = topk
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.balancing = balancing
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.score = score
        self.router = Router(hidden_size, num_experts, expert_bias=balancing == "expert_bias")
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, approximate)
        self.ep_group: dist.ProcessGroup | None = None
        """Set by expert parallelism: this rank holds experts ``ep_rank * E / P`` onwards."""
        self.runtime: MoERuntime | None = None
        """Shared with the model's other MoE layers by the engine (loss scales per step)."""
        self.stats: RouterStats | None = None
        self.layer_index = 0
        """The block this layer sits in (set by install_moe): where its row of statistics goes."""

    # ---- statistics -----------------------------------------------------------------
    def take_stats(self) -> RouterStats:
        """The statistics since the last call (zeros if none), and start afresh."""
        device = self.router.gate.weight.device
        stats = self.stats or RouterStats.zeros(self.num_experts, device)
        self.stats = None
        return stats

    def _stats(self, device: torch.device) -> RouterStats:
        if self.stats is None:
            self.stats = RouterStats.zeros(self.num_experts, device)
        return self.stats

    # ---- forward --------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        logits = self.router(flat)
        routing = route(logits, self.topk, self.score, self.router.expert_bias)
        token, expert, weight, keep = self._assignments(routing)
        if self.capacity_factor is not None:  # (a boolean mask reads its count to the host)
            token, expert, weight = token[keep], expert[keep], weight[keep]
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        y = self._experts(flat[token], counts)
        weighted = y * weight[:, None].to(y.dtype)
        out = torch.zeros_like(flat, dtype=y.dtype).index_add(0, token, weighted)
        out = out.to(x.dtype).view(batch, length, hidden)
        if not torch.is_grad_enabled():
            if self.runtime is not None and self.runtime.counting:
                self.runtime.count(self, routing)  # global_aux_loss's pass before the step
            return out
        # A recompute (activation checkpointing) runs the same operations (checkpoint checks
        # that it saves as many tensors) but counts nothing: the first forward's graph, which
        # backward walks, already carries the losses with their scale.
        counting = not in_recompute()
        scale = UNIT_SCALE
        if self.runtime is not None and counting:
            scale = self.runtime.next_scale(self)
        stats = self._stats(x.device) if counting else RouterStats.zeros(self.num_experts, x.device)
        stats.received += counts.float()
        stats.step_counts += routing.counts.float()
        stats.assigned += routing.experts.numel()
        stats.dropped += (~keep).sum()
        if not self.training:
            return out
        if self.balancing in ("aux_loss", "seq_aux_loss") and self.aux_loss_coeff:
            aux = self.aux_loss_coeff * load_balancing_loss(routing, batch, self.balancing)
            out = attach_aux_loss(out, aux, scale)
            stats.aux.append((scale, aux.detach()))
        if self.balancing == "global_aux_loss" and self.aux_loss_coeff:
            assert self.runtime is not None
            step_counts, step_tokens = self.runtime.global_share(self)
            aux = self.aux_loss_coeff * global_balancing_loss(routing, step_counts, step_tokens)
            # Weighted by this micro-batch's share of the step's tokens (times dp: gradient
            # averaging divides by it), not like the language-model loss.
            share = AuxScale(self.runtime.dp * flat.shape[0] / step_tokens)
            out = attach_aux_loss(out, aux, share)
            stats.aux.append((share, aux.detach()))
        if self.z_loss_coeff:
            z = self.z_loss_coeff * z_loss(logits)
            out = attach_aux_loss(out, z, scale)
            stats.z.append((scale, z.detach()))
        return out

    def _assignments(
        self, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flattened (token, expert, weight, kept) of every assignment."""
        tokens, k = routing.experts.shape
        token = torch.arange(tokens, device=routing.experts.device).repeat_interleave(k)
        expert = routing.experts.flatten()
        weight = routing.weights.flatten()
        if self.capacity_factor is None:
            return token, expert, weight, torch.ones_like(expert, dtype=torch.bool)
        capacity = math.ceil(self.capacity_factor * tokens * k / self.num_experts)
        # Rank each assignment within its expert: by score (probs) or by token position.
        key = -weight.detach() if self.drop_policy == "probs" else token.float()
        by_key = torch.argsort(key, stable=True)
        by_expert = by_key[torch.argsort(expert[by_key], stable=True)]
        starts = torch.cumsum(routing.counts, 0) - routing.counts
        rank = torch.empty_like(expert)
        rank[by_expert] = (
            torch.arange(len(expert), device=expert.device) - starts[expert[by_expert]]
        )
        return token, expert, weight, rank < capacity

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every row through its expert: here, or on the rank of the ep group holding it."""
        group = self.ep_group
        if group is None or dist.get_world_size(group) == 1:
            return self.experts(rows, counts)
        size = dist.get_world_size(group)
        local = self.num_experts // size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source, my expert] counts
        send = counts.view(size, local).sum(1).tolist()
        receive_by = received.view(size, local)
        recv = receive_by.sum(1).tolist()
        inbound = _exchange(rows, recv, send, group)
        # Arrivals are ordered by source rank, then expert: regroup them by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(size), receive_by.flatten()
        )
        order = torch.argsort(expert_of_row, stable=True)
        computed = self.experts(inbound[order], receive_by.sum(0))
        back = torch.empty_like(computed)
        back[order] = computed
        return _exchange(back, send, recv, group)


def _exchange(
    rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows to and from the ep ranks (``send[j]`` rows go to rank j), differentiable."""
    out = all_to_all_single_autograd(rows.contiguous(), receive, send, group)
    return torch.ops._c10d_functional.wait_tensor(out)


UNIT_SCALE = AuxScale()
"""The scale of a layer used outside an engine: the losses enter with their coefficient."""


def moe_layers(modules: list[nn.Module]) -> list[MoELayer]:
    """Every MoE layer in ``modules``, in order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters held per expert (the stacked weights), in order."""
    return [p for layer in moe_layers(modules) for p in layer.experts.parameters()]


@dataclass(frozen=True)
class MoESpec:
    """Which layers of a built-in model are MoE, and how they route (the MoE flags)."""

    num_experts: int
    layers: tuple[int, ...]
    """Indices of the blocks whose FFN is an MoE layer."""
    topk: int = 2
    ffn_hidden_size: int | None = None
    """Each expert's hidden width; None: the dense FFN's."""
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    balancing: Balancing = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float | None = None
    score: Score = "softmax"

    def layer(self, hidden_size: int, dense_ffn_size: int, approximate: str) -> MoELayer:
        return MoELayer(
            hidden_size,
            self.ffn_hidden_size or dense_ffn_size,
            self.num_experts,
            topk=self.topk,
            approximate=approximate,
            capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy,
            balancing=self.balancing,
            aux_loss_coeff=self.aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff,
            score=self.score,
        )


def install_moe(
    blocks: nn.ModuleDict, spec: MoESpec | None, hidden_size: int, ffn_size: int, approximate: str
) -> None:
    """Put an MoE layer in the FFN slot of every block ``spec.layers`` names."""
    if spec is None:
        return
    for name, block in blocks.items():
        if int(name) in spec.layers:
            block.ffn = spec.layer(hidden_size, ffn_size, approximate)
            block.ffn.layer_index = int(name)


def reset_buffers(model: nn.Module) -> None:
    """Give the MoE layers' buffers (the expert bias) their initial value: zero."""
    for layer in moe_layers([model]):
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()
