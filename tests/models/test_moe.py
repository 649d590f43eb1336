"""The MoE layer against a plain reference written here: a loop over tokens and experts.

Outputs and gradients (input, router, experts) within 1e-6 for top-1 and top-2, softmax and
sigmoid scores, dropless and with a capacity (both drop policies), on both expert kernels
(torch._grouped_mm and the per-expert loop); the auxiliary losses' values against their
formulas on the same routing; the dropped count against one counted here.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rapidformer.models.moe import grouped_mm_supported
from rapidformer.models.moe_router import route
from tests.helpers.moe import BATCH, EXPERTS, HIDDEN, LENGTH, TOLERANCE, make_layer, reference

CASES = [
    pytest.param({"topk": 1, "score": "softmax"}, id="top1-softmax"),
    pytest.param({"topk": 2, "score": "softmax"}, id="top2-softmax"),
    pytest.param({"topk": 1, "score": "sigmoid"}, id="top1-sigmoid"),
    pytest.param({"topk": 2, "score": "sigmoid"}, id="top2-sigmoid"),
    pytest.param({"topk": 2, "capacity_factor": 1.0}, id="top2-capacity-probs"),
    pytest.param(
        {"topk": 2, "capacity_factor": 1.0, "drop_policy": "position"},
        id="top2-capacity-position",
    ),
    pytest.param({"topk": 1, "capacity_factor": 0.5, "score": "sigmoid"}, id="top1-capacity"),
]


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
@pytest.mark.parametrize("options", CASES)
def test_layer_matches_the_token_by_token_reference(options: dict, kernel: str) -> None:
    layer = make_layer(aux_loss_coeff=0.0, **options)
    layer.experts.force_loop = kernel == "loop"
    assert layer.experts.kernel(torch.float32, torch.device("cpu")) == kernel
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(2))

    x_layer = x.clone().requires_grad_()
    out = layer(x_layer)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}

    # The reference in float64: the bound is the fp32 layer's own rounding.
    exact = copy.deepcopy(layer).double()
    x_ref = x.double().requires_grad_()
    expected, _, dropped = reference(exact, x_ref)
    (expected * probe.double()).sum().backward()

    assert (out - expected).abs().max() <= TOLERANCE
    assert (x_layer.grad - x_ref.grad).abs().max() <= TOLERANCE
    for name, param in exact.named_parameters():
        assert (grads[name] - param.grad).abs().max() <= TOLERANCE, name
    stats = layer.take_stats()
    assert int(stats.dropped) == sum(dropped)
    if options.get("capacity_factor") is not None:
        assert sum(dropped) > 0, "the case must drop something"


def test_dropped_tokens_pass_through_the_block_unchanged() -> None:
    layer = make_layer(topk=1, capacity_factor=0.25, aux_loss_coeff=0.0)
    x = torch.randn(1, 16, HIDDEN, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    routing = route(layer.router(x.view(-1, HIDDEN)), 1, "softmax")
    capacity = math.ceil(0.25 * 16 / EXPERTS)
    expected_drops = int(sum(max(0, int(c) - capacity) for c in routing.counts))
    zero_rows = int((out.view(-1, HIDDEN).abs().sum(-1) == 0).sum())
    assert zero_rows == expected_drops > 0  # top-1: a dropped token gets nothing added


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_auxiliary_losses_equal_their_formulas(score: str) -> None:
    coefficient, z_coefficient = 0.1, 0.01
    layer = make_layer(topk=2, score=score, aux_loss_coeff=coefficient, z_loss_coeff=z_coefficient)
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(4))
    layer(x)
    stats = layer.take_stats()
    _, aux, _ = reference(layer, x)
    assert abs(float(stats.aux[0][1]) - coefficient * float(aux)) <= TOLERANCE
    logits = x.view(-1, HIDDEN) @ layer.router.gate.weight.t()
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    assert abs(float(stats.z[0][1]) - z_coefficient * float(z)) <= TOLERANCE


def test_sequence_aux_loss_averages_each_sequence() -> None:
    layer = make_layer(topk=2, balancing="seq_aux_loss", aux_loss_coeff=1.0)
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(5))
    layer(x)
    got = float(layer.take_stats().aux[0][1])
    per_sequence = []
    for b in range(BATCH):
        _, aux, _ = reference(layer, x[b : b + 1])
        per_sequence.append(float(aux))
    assert abs(got - sum(per_sequence) / BATCH) <= TOLERANCE


def test_aux_loss_gradient_reaches_the_router_with_its_coefficient() -> None:
    layer = make_layer(topk=2, aux_loss_coeff=0.5)
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(6))
    layer(x).sum().mul(0.0).backward()  # only the attached loss reaches the gradients
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    _, aux, _ = reference(layer, x)
    (0.5 * aux).backward()
    assert (got - layer.router.gate.weight.grad).abs().max() <= TOLERANCE
    assert got.abs().max() > 1e-4


def test_expert_bias_steers_the_choice_not_the_weights() -> None:
    layer = make_layer(topk=1, balancing="expert_bias")
    assert layer.router.expert_bias is not None
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(7))
    layer.router.expert_bias.fill_(0.0)
    layer.router.expert_bias[3] = 10.0  # every token now chooses expert 3
    with torch.no_grad():
        logits = layer.router(x.view(-1, HIDDEN))
    routing = route(logits, 1, "softmax", layer.router.expert_bias)
    assert set(routing.experts.flatten().tolist()) == {3}
    assert torch.allclose(routing.weights, torch.ones_like(routing.weights))


def test_grouped_mm_is_used_where_supported() -> None:
    assert grouped_mm_supported(torch.float32, torch.device("cpu"), (16, 24))
    assert not grouped_mm_supported(torch.float32, torch.device("cpu"), (16, 20))
    assert not grouped_mm_supported(torch.float16, torch.device("cpu"), (16, 24))
