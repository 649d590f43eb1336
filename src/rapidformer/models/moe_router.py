"""The router of a mixture-of-experts layer, its auxiliary losses, and how they reach the
gradients.

**Routing** (token choice, top-k). The router is one bias-free linear map ``hidden -> experts``
computed in fp32 whatever the autocast dtype (a bf16 softmax over experts ties and flips
choices). Scores are ``softmax(logits)`` or ``sigmoid(logits)``; each token takes the k experts
with the highest score (plus, with ``expert_bias`` balancing, a per-expert bias that only
affects the choice), and its k chosen scores, normalised to sum to one, weight the experts'
outputs (Megatron's and Mixtral's default; for top-1 the weight is 1 and the router learns from
the balancing loss alone).

**Auxiliary losses** on one micro-batch of N tokens, E experts (each is 1 when balanced):

* ``aux_loss`` (Switch / GShard): ``E * sum_i f_i * P_i``, ``f_i`` the fraction of the N x k
  assignments that chose expert i (a count: no gradient), ``P_i`` the mean score of expert i
  (softmax probabilities, or sigmoid scores normalised per token);
* ``seq_aux_loss``: the same per sequence, averaged over the sequences;
* ``global_aux_loss``: the same over the whole global batch (every micro-batch of the step on
  every data-parallel rank): ``f_i`` is counted in a routing pass before the step (see
  :class:`MoERuntime`), and micro-batch m contributes ``E * sum_i f_i * P_i(m)`` with weight
  ``N_m / N`` (its share of the step's tokens), which sums to ``E * sum_i f_i * P_i`` of the
  concatenated batch;
* z-loss (ST-MoE): ``mean_tokens(logsumexp(logits)^2)``, which keeps the logits small.

They are added to the gradients without any loss hook knowing (Megatron's device): the layer
output passes through :class:`_AttachAuxLoss`, whose backward hands the loss the gradient
``coefficient x scale`` where ``scale`` is the weight the engine gives this micro-batch's
language-model loss (its share of the step's units, see :mod:`rapidformer.engine.engine`). So the
auxiliary loss enters the objective exactly once per micro-batch, under accumulation and
pipeline schedules alike, weighted like the main loss. The scale is read at backward time from
an :class:`AuxScale` cell that the engine fills, which lets hand-written loops (weights known
only at ``backward``) use the same path.

**Statistics** for the logs (tokens each expert got, dropped assignments, the losses' values)
stay on the device and are read at log intervals only; a recompute (activation checkpointing)
counts nothing again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

Balancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "expert_bias", "none"]
Score = Literal["softmax", "sigmoid"]


class AuxScale:
    """The weight of one micro-batch's losses, filled by the engine (1 outside an engine)."""

    def __init__(self, value: float | torch.Tensor = 1.0) -> None:
        self.value = value


class MoERuntime:
    """What the MoE layers of one model share during a step: the micro-batches' loss scales
    and how many forwards each layer has run in this step (its micro-batch index: every
    schedule runs a layer's forwards in micro-batch order).

    For ``global_aux_loss`` also the step's routing counts: while ``counting`` (a no-grad pass
    over the step's micro-batches that the engine runs first), each layer adds its chosen
    experts and tokens; the engine sums them over the data-parallel ranks and hands them back
    with :meth:`set_global_counts`, which the training forwards then read."""

    def __init__(self) -> None:
        self.scales: list[AuxScale] = []
        self.calls: dict[int, int] = {}
        self.counting = False
        self.counted: dict[int, torch.Tensor] = {}
        """Layer id -> [E + 1]: assignments per expert, then tokens (the counting pass)."""
        self.global_counts: dict[int, torch.Tensor] = {}
        self.dp = 1
        """The data-parallel size, by which gradient averaging divides every loss's weight."""

    def count(self, layer: nn.Module, routing: Routing) -> None:
        # int64 (exact at any batch size); the token count is made on the device, not copied.
        tokens = routing.counts.new_full((1,), routing.experts.shape[0])
        row = torch.cat([routing.counts, tokens])
        self.counted[id(layer)] = self.counted.get(id(layer), 0) + row

    def set_global_counts(self, counts: dict[int, torch.Tensor]) -> None:
        self.counting = False
        self.counted = {}
        self.global_counts = counts

    def global_share(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(assignments per expert [E], tokens) of the whole step, for ``layer``."""
        counts = self.global_counts.get(id(layer))
        if counts is None:
            raise RuntimeError(
                "--moe-router-load-balancing-type global_aux_loss counts the routing of the "
                "whole step before its first backward: train through engine.run_step() (a "
                "hand-written loop with engine.backward() cannot), or use aux_loss"
            )
        return counts[:-1].float(), counts[-1].float()

    def begin_step(self, scales: torch.Tensor | None = None) -> None:
        """A new optimizer step; ``scales`` (one per micro-batch) when known before it runs.
        The last step's global counts are dropped: a step whose counting pass did not run
        must not train on them."""
        self.calls.clear()
        self.global_counts = {}
        values = [] if scales is None else list(scales.detach())
        self.scales = [AuxScale(v) for v in values]

    def next_scale(self, layer: nn.Module) -> AuxScale:
        index = self.calls.get(id(layer), 0)
        self.calls[id(layer)] = index + 1
        return self._cell(index)

    def current_scale(self) -> AuxScale:
        """The cell of the micro-batch whose forward ran last (hand-written loops set it)."""
        return self._cell(max(self.calls.values(), default=1) - 1)

    def _cell(self, index: int) -> AuxScale:
        while len(self.scales) <= index:  # weights not known before the step: 1 until set
            self.scales.append(AuxScale())
        return self.scales[index]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; backward also gives ``loss`` the gradient ``scale.value``."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: AuxScale
    ) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        value = torch.as_tensor(ctx.scale.value, dtype=torch.float32, device=grad.device)
        return grad, value.expand(ctx.loss_shape), None


def attach_aux_loss(output: torch.Tensor, loss: torch.Tensor, scale: AuxScale) -> torch.Tensor:
    """``output``, carrying ``loss`` into the backward with weight ``scale.value``."""
    return _AttachAuxLoss.apply(output, loss, scale)


_UNCOUNTED: list[bool] = [False]


@contextmanager
def uncounted() -> Iterator[None]:
    """Forwards that are not a micro-batch's (a pipeline stage's shape-inference pass on
    placeholder values) count nothing and attach no loss scale."""
    previous = _UNCOUNTED[0]
    _UNCOUNTED[0] = True
    try:
        yield
    finally:
        _UNCOUNTED[0] = previous


def in_recompute() -> bool:
    """Whether this forward is activation checkpointing's recompute (inside a backward), or
    another forward that must count nothing (:func:`uncounted`)."""
    return _UNCOUNTED[0] or bool(torch._C._current_graph_task_id() != -1)


@dataclass
class Routing:
    """One micro-batch's routing: for each token its k experts and their weights."""

    experts: torch.Tensor
    """[N, k] expert index of each assignment."""
    weights: torch.Tensor
    """[N, k] fp32 weight of each assignment (the chosen scores normalised)."""
    scores: torch.Tensor
    """[N, E] fp32 scores of every expert (normalised to sum 1 per token)."""
    logits: torch.Tensor
    """[N, E] fp32 router logits."""
    counts: torch.Tensor = field(init=False)
    """[E] assignments each expert was chosen for (before any capacity drop)."""

    def __post_init__(self) -> None:
        num_experts = self.scores.shape[-1]
        self.counts = torch.bincount(self.experts.flatten(), minlength=num_experts)


def route(
    logits: torch.Tensor, topk: int, score: Score, bias: torch.Tensor | None = None
) -> Routing:
    """Token-choice top-k routing of fp32 ``logits`` [N, E] (see the module docstring)."""
    raw = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choose = raw if bias is None else raw + bias.detach()
    experts = choose.topk(topk, dim=-1).indices
    chosen = raw.gather(-1, experts)
    weights = chosen / chosen.sum(-1, keepdim=True)
    scores = raw if score == "softmax" else raw / raw.sum(-1, keepdim=True)
    return Routing(experts=experts, weights=weights, scores=scores, logits=logits)


def global_balancing_loss(
    routing: Routing, step_counts: torch.Tensor, step_tokens: torch.Tensor
) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` with ``f_i`` from the whole step's counts and ``P_i`` this
    micro-batch's mean score (weight it by the micro-batch's share of the step's tokens)."""
    experts = routing.scores.shape[-1]
    fraction = step_counts / (step_tokens * routing.experts.shape[-1])  # no gradient
    return experts * (fraction * routing.scores.mean(0)).sum()


def load_balancing_loss(routing: Routing, sequences: int, kind: Balancing) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` over the micro-batch (``aux_loss``) or per sequence and
    averaged (``seq_aux_loss``; tokens are ``sequences`` contiguous runs)."""
    tokens, experts = routing.scores.shape
    groups = sequences if kind == "seq_aux_loss" else 1
    scores = routing.scores.view(groups, tokens // groups, experts)
    chosen = F.one_hot(routing.experts, experts).sum(1).view(groups, tokens // groups, experts)
    fraction = chosen.float().mean(1) / routing.experts.shape[-1]  # f_i: no gradient
    mean_score = scores.mean(1)  # P_i
    return experts * (fraction * mean_score).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean(logsumexp(logits)^2)`` over the tokens."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class Router(nn.Module):
    """``hidden -> experts`` logits in fp32, and the expert bias of ``expert_bias``
    balancing (a buffer: it is moved by load counts, not by gradients)."""

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.expert_bias: torch.Tensor | None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight.float())


@dataclass
class RouterStats:
    """A layer's routing statistics since they were last read (device tensors)."""

    received: torch.Tensor
    """[E] assignments each expert computed (after any drop), summed over micro-batches."""
    step_counts: torch.Tensor
    """[E] assignments each expert was chosen for in the current step (expert bias update)."""
    assigned: torch.Tensor
    """Assignments routed (N x k summed)."""
    dropped: torch.Tensor
    """Assignments dropped by the capacity."""
    aux_total: torch.Tensor
    """Sum over the finished steps of (scale x coefficient x load-balancing loss)."""
    z_total: torch.Tensor
    aux: list[tuple[AuxScale, torch.Tensor]] = field(default_factory=list)
    """This step's (scale cell, coefficient x loss) per micro-batch: the scale may be set
    only at backward (hand-written loops), so it is folded in at the step's end."""
    z: list[tuple[AuxScale, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | str) -> RouterStats:
        zero = torch.zeros((), device=device)
        return cls(
            received=torch.zeros(num_experts, device=device),
            step_counts=torch.zeros(num_experts, device=device),
            assigned=zero.clone(),
            dropped=zero.clone(),
            aux_total=zero.clone(),
            z_total=zero.clone(),
        )

    def end_step(self) -> None:
        """Fold this step's weighted losses into the totals (on the device, no sync)."""
        for pairs, total in ((self.aux, self.aux_total), (self.z, self.z_total)):
            for cell, value in pairs:
                scale = torch.as_tensor(cell.value, dtype=torch.float32, device=value.device)
                total += scale * value
            pairs.clear()
        self.step_counts.zero_()
