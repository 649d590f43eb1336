"""The built-in GPT: meta-device build, structure for parallelism, causality, learning."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidformer.models import GPTConfig, GPTModel, SelfAttention, TransformerBlock
from rapidformer.models.blocks import find_blocks
from tests.helpers.models import MODEL_SHAPE, TP_STYLE_KINDS

TINY = GPTConfig(**MODEL_SHAPE, dropout=0.0)


def tiny(**overrides: Any) -> GPTConfig:
    return dataclasses.replace(TINY, **overrides)


def test_config_defaults_and_validation() -> None:
    config = GPTConfig(**MODEL_SHAPE)
    assert config.ffn_hidden_size is None and config.ffn_size == 128
    assert tiny(hidden_size=64, num_attention_heads=8).ffn_size == 256
    assert (config.dropout, config.layernorm_epsilon, config.tie_word_embeddings) == (
        0.1,
        1e-5,
        True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="divisible"):
        tiny(num_attention_heads=5)


def test_build_on_meta_materialises_deterministically() -> None:
    config = tiny()
    model = GPTModel.build(config, seed=1)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.token_embeddings.weight
    same = GPTModel.build(config, seed=1).state_dict()
    other = GPTModel.build(config, seed=2).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not torch.equal(
        state["blocks.0.attention.q_proj.weight"], other["blocks.0.attention.q_proj.weight"]
    )

    block = model.blocks["0"]
    assert isinstance(block, TransformerBlock)
    assert torch.equal(block.attention_norm.weight, torch.ones(32))
    assert torch.equal(block.attention.q_proj.bias, torch.zeros(32))
    assert model.token_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # GPT-2's scaled init of the residual output projections: 0.02 / sqrt(2 * layers).
    assert block.ffn.fc2.weight.std().item() == pytest.approx(0.01, rel=0.1)

    untied = GPTModel.build(tiny(tie_word_embeddings=False), seed=1)
    assert untied.lm_head.weight is not untied.token_embeddings.weight


def test_blocks_are_found_and_have_an_ffn() -> None:
    model = GPTModel.build(tiny(num_layers=3))
    blocks = find_blocks(model)
    assert blocks == list(model.blocks.values()) and len(blocks) == 3
    for block in blocks:
        assert isinstance(block, TransformerBlock)
        assert isinstance(block.ffn.fc1, nn.Linear) and isinstance(block.ffn.fc2, nn.Linear)


def test_tp_plan_patterns_match_modules_of_the_right_kind() -> None:
    model = GPTModel.build(tiny())
    modules = dict(model.named_modules())
    for pattern, style in model.tp_plan.items():
        matched = [m for name, m in modules.items() if fnmatch.fnmatchcase(name, pattern)]
        assert matched, pattern
        kind = TP_STYLE_KINDS[style]
        assert all(isinstance(m, kind) for m in matched), pattern


def test_attention_splits_by_heads_as_the_tp_plan_says() -> None:
    """Colwise Q/K/V + rowwise out_proj on 2 'ranks' (done by hand) equals the whole layer."""
    torch.manual_seed(0)
    full = SelfAttention(32, 4, dropout=0.0, causal=True)
    x = torch.randn(2, 8, 32)
    partial = torch.zeros(2, 8, 32)
    for rank in range(2):
        # What a TP rank holds: 2 of the 4 heads in Q/K/V, the matching out_proj inputs.
        shard = SelfAttention(32, 4, dropout=0.0, causal=True)
        rows = slice(16 * rank, 16 * (rank + 1))
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                local = nn.Linear(32, 16)
                local.weight.copy_(getattr(full, name).weight[rows])
                local.bias.copy_(getattr(full, name).bias[rows])
                setattr(shard, name, local)
            shard.out_proj = nn.Linear(16, 32, bias=False)
            shard.out_proj.weight.copy_(full.out_proj.weight[:, rows])
            partial += shard(x)
    torch.testing.assert_close(partial + full.out_proj.bias, full(x), rtol=0, atol=1e-6)


ACROSS_SHAPES = 1e-6
"""Logits of a padded length-12 forward against a length-8 one: different shapes run different
kernel blockings (seen on an AMD EPYC with AVX-512: 226 of 800 logits off by up to 4.5e-8), so
they agree to rounding, not bitwise."""


def test_causal_and_right_padding() -> None:
    model = GPTModel.build(tiny(), seed=3).eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 100
    padded = torch.cat([ids[:, :8], torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 8 + [0] * 4])
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (1, 12, 100)
        # Same shape, same computation for the first 8 positions: causal means bitwise equal.
        torch.testing.assert_close(model(changed)[:, :8], logits[:, :8], rtol=0, atol=0)
        unpadded = model(ids[:, :8])
        torch.testing.assert_close(model(padded, mask)[:, :8], unpadded, rtol=0, atol=ACROSS_SHAPES)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_training_steps_lower_the_loss() -> None:
    model = GPTModel.build(tiny(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    losses: list[float] = []
    for _ in range(15):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
