"""The MoE layer the model tests build, and a plain reference of it: a loop over tokens and
experts (shared by the CPU tests and the CUDA ones)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rapidformer.models.moe import MoELayer

HIDDEN, FFN, EXPERTS, BATCH, LENGTH = 16, 24, 4, 3, 8
TOLERANCE = 1e-6


def make_layer(**options: object) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, EXPERTS, **options)  # type: ignore[arg-type]
    with torch.no_grad():
        layer.router.gate.weight.normal_(0.0, 0.5)
        for param in layer.experts.parameters():
            param.normal_(0.0, 0.1)
    return layer


def reference(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(output, load-balancing loss without its coefficient, dropped per expert), token by
    token."""
    tokens = x.reshape(-1, HIDDEN)
    gate = layer.router.gate.weight
    w1, b1, w2, b2 = layer.experts.w1, layer.experts.b1, layer.experts.w2, layer.experts.b2
    choices = []  # per token: [(expert, weight, score)]
    all_scores = []
    for t in range(tokens.shape[0]):
        logits = torch.stack([tokens[t] @ gate[e] for e in range(EXPERTS)])
        if layer.score == "softmax":
            raw = torch.exp(logits) / torch.exp(logits).sum()
            normalised = raw
        else:
            raw = 1 / (1 + torch.exp(-logits))
            normalised = raw / raw.sum()
        all_scores.append(normalised)
        ranked = sorted(range(EXPERTS), key=lambda e: -float(raw[e]))[: layer.topk]
        total = sum(raw[e] for e in ranked)
        choices.append([(e, raw[e] / total) for e in ranked])
    # Capacity: per expert, keep the highest-weight (probs) or earliest (position) ones.
    kept = {(t, e) for t, c in enumerate(choices) for e, _ in c}
    dropped = [0] * EXPERTS
    if layer.capacity_factor is not None:
        capacity = math.ceil(layer.capacity_factor * len(choices) * layer.topk / EXPERTS)
        for e in range(EXPERTS):
            users = [(t, float(w)) for t, c in enumerate(choices) for ce, w in c if ce == e]
            if layer.drop_policy == "probs":
                users.sort(key=lambda u: -u[1])
            for t, _ in users[capacity:]:
                kept.discard((t, e))
                dropped[e] += 1
    outputs = []
    for t, chosen in enumerate(choices):
        out = torch.zeros(HIDDEN, dtype=tokens.dtype)
        for e, weight in chosen:
            if (t, e) in kept:
                h = F.gelu(tokens[t] @ w1[e] + b1[e], approximate="tanh")
                out = out + weight * (h @ w2[e] + b2[e])
        outputs.append(out)
    # Switch / GShard: E * sum_i f_i * P_i over the micro-batch.
    count = torch.zeros(EXPERTS, dtype=tokens.dtype)
    for chosen in choices:
        for e, _ in chosen:
            count[e] += 1
    fraction = count / (len(choices) * layer.topk)
    mean_score = torch.stack(all_scores).mean(0)
    aux = EXPERTS * (fraction * mean_score).sum()
    return torch.stack(outputs).view_as(x), aux, dropped
