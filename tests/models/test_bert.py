"""The built-in BERT: meta-device build, structure for parallelism, padding, learning."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidformer.models import BertConfig, BertModel, TransformerBlock
from rapidformer.models.blocks import find_blocks
from tests.helpers.models import MODEL_SHAPE, TP_STYLE_KINDS

MASK_ID = 3


TINY = BertConfig(**MODEL_SHAPE, dropout=0.0)


def tiny(**overrides: Any) -> BertConfig:
    return dataclasses.replace(TINY, **overrides)


def test_config_defaults() -> None:
    config = BertConfig(**MODEL_SHAPE)
    assert (config.type_vocab_size, config.ffn_size, config.dropout) == (2, 128, 0.1)
    assert config.layernorm_epsilon == 1e-12
    assert tiny(ffn_hidden_size=48).ffn_size == 48


def test_build_on_meta_materialises_deterministically() -> None:
    config = tiny()
    model = BertModel.build(config, seed=1)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.token_embeddings.weight
    assert torch.equal(model.lm_head.bias, torch.zeros(100))
    same = BertModel.build(config, seed=1).state_dict()
    other = BertModel.build(config, seed=2).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not torch.equal(state["pooler.weight"], other["pooler.weight"])
    # BERT has no scaled residual init: fc2 uses the plain 0.02.
    assert state["blocks.1.ffn.fc2.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_blocks_are_found_and_have_an_ffn() -> None:
    model = BertModel.build(tiny(num_layers=3))
    blocks = find_blocks(model)
    assert blocks == list(model.blocks.values()) and len(blocks) == 3
    for block in blocks:
        assert isinstance(block, TransformerBlock)
        assert isinstance(block.ffn.fc1, nn.Linear) and isinstance(block.ffn.fc2, nn.Linear)


def test_tp_plan_patterns_match_modules_of_the_right_kind() -> None:
    model = BertModel.build(tiny())
    modules = dict(model.named_modules())
    for pattern, style in model.tp_plan.items():
        matched = [m for name, m in modules.items() if fnmatch.fnmatchcase(name, pattern)]
        assert matched, pattern
        kind = TP_STYLE_KINDS[style]
        assert all(isinstance(m, kind) for m in matched), pattern


def test_padding_is_ignored_and_token_types_default_to_zero() -> None:
    model = BertModel.build(tiny(), seed=3).eval()
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    other = ids.clone()
    other[1, 7:] = 0
    with torch.no_grad():
        mlm, sop = model(ids, attention_mask=mask)
        assert mlm.shape == (2, 12, 100) and sop.shape == (2, 2)
        mlm_other, sop_other = model(other, attention_mask=mask)
        torch.testing.assert_close(mlm_other[mask.bool()], mlm[mask.bool()], rtol=0, atol=1e-6)
        torch.testing.assert_close(sop_other, sop, rtol=0, atol=1e-6)
        zeros = torch.zeros_like(ids)
        torch.testing.assert_close(model(ids, zeros)[0], model(ids)[0], rtol=0, atol=0)
        assert not torch.allclose(model(ids, torch.ones_like(ids))[0], model(ids)[0])


def test_training_steps_lower_the_mlm_loss() -> None:
    model = BertModel.build(tiny(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 100, (4, 16), generator=generator)
    masked = torch.rand(4, 16, generator=generator) < 0.25
    inputs = tokens.masked_fill(masked, MASK_ID)
    labels = tokens.masked_fill(~masked, -100)
    token_types = (torch.arange(16) >= 8).long().expand(4, -1)
    order = torch.tensor([0, 1, 0, 1])
    losses: list[float] = []
    for _ in range(15):
        mlm, sop = model(inputs, token_types)
        mlm_loss = F.cross_entropy(mlm.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        (mlm_loss + F.cross_entropy(sop, order)).backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        optimizer.step()
        losses.append(mlm_loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
