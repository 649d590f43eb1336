"""The built-in models cut into pipeline stages by hand (no schedule): stable names, the same
loss and gradients as the whole model, the tied embedding handled Megatron's way, and
meta-device construction that initialises any piece (a stage, an FSDP2 shard) with the whole
model's values."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidformer.models import BertConfig, BertModel, GPTConfig, GPTModel
from rapidformer.models.stages import StagedModel, materialize
from rapidformer.testing import run_distributed
from tests.helpers.models import MODEL_SHAPE

SPLIT = 1e-6
"""Stages compute the same operations on the same values as the whole model, split at a block
boundary: losses and gradients agree to rounding."""

GPT = GPTConfig(**{**MODEL_SHAPE, "num_layers": 4}, dropout=0.0)
BERT = BertConfig(**{**MODEL_SHAPE, "num_layers": 4}, dropout=0.0)


def _stage(config: GPTConfig | BertConfig, layers: range, first: bool, last: bool) -> StagedModel:
    """A stage built on the meta device, then materialised and initialised on its own."""
    cls = GPTModel if isinstance(config, GPTConfig) else BertModel
    stage = cls.build(config, device="meta", seed=7).keep_stage(layers, first=first, last=last)
    materialize(stage, "cpu")
    stage.init_weights()
    return stage


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.clone()
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }


def test_a_gpt_split_in_two_stages_equals_the_whole_model() -> None:
    whole = GPTModel.build(GPT, seed=7)
    first = _stage(GPT, range(0, 2), first=True, last=False)
    last = _stage(GPT, range(2, 4), first=False, last=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, 12), generator=generator)
    labels = torch.randint(0, 100, (3, 12), generator=generator)

    # The same names: each stage's are the whole model's of its layers, and together they
    # are every state-dict key (the tied head appears as lm_head.weight on the last stage).
    names = [set(m.state_dict()) for m in (first, last)]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(whole.state_dict())
    assert set(first.blocks) == {"0", "1"} and set(last.blocks) == {"2", "3"}
    assert first.lm_head is None and last.token_embeddings is None
    # Meta-built stages get the whole model's initial values, the head the embedding's.
    state = whole.state_dict()
    for stage in (first, last):
        assert all(torch.equal(v, state[k]) for k, v in stage.state_dict().items())

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    expected = loss_of(whole(ids))
    expected.backward()
    hidden = first(ids)
    assert hidden.shape == (3, 12, 32)  # hidden states cross the stage boundary
    loss = loss_of(last(hidden))
    loss.backward()
    assert abs(loss.item() - expected.item()) <= SPLIT
    reference, split = _grads(whole), {**_grads(first), **_grads(last)}
    # The tied weight: each copy got the gradient of its own use; their sum is the whole's.
    tied = split.pop("token_embeddings.weight") + split.pop("lm_head.weight")
    torch.testing.assert_close(tied, reference.pop("token_embeddings.weight"), rtol=0, atol=SPLIT)
    reference.pop("lm_head.weight")
    assert split.keys() == reference.keys()
    for name, grad in split.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=SPLIT, msg=name)
    assert last.tied_weights == {"lm_head.weight": "token_embeddings.weight"}


def test_a_bert_split_in_three_stages_equals_the_whole_model() -> None:
    whole = BertModel.build(BERT, seed=7).eval()
    stages = [
        _stage(BERT, range(0, 1), first=True, last=False),
        _stage(BERT, range(1, 3), first=False, last=False),
        _stage(BERT, range(3, 4), first=False, last=True),
    ]
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    types = torch.zeros_like(ids)
    with torch.no_grad():
        mlm, sop = whole(ids, types, mask)
        # Each stage returns (hidden states, mask) and the next takes them as they come: the
        # padding mask crosses the stages as a pipeline sends it.
        carried = stages[0](ids, types, mask)
        assert isinstance(carried, tuple) and carried[1] is mask
        carried = stages[1](*carried)
        split_mlm, split_sop = stages[2](*carried)
    torch.testing.assert_close(split_mlm, mlm, rtol=0, atol=SPLIT)
    torch.testing.assert_close(split_sop, sop, rtol=0, atol=SPLIT)
    assert stages[1].is_first_stage is False and stages[1].is_last_stage is False
    assert set(stages[1].state_dict()) == {k for k in whole.state_dict() if k[7:9] in ("1.", "2.")}


def test_meta_construction_and_stage_errors() -> None:
    meta = GPTModel.build(GPT, device="meta", seed=7)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head is not None and meta.lm_head.weight is meta.token_embeddings.weight  # type: ignore[union-attr]
    materialize(meta, "cpu")  # the tie survives materialisation
    assert meta.lm_head is not None and meta.lm_head.weight is meta.token_embeddings.weight  # type: ignore[union-attr]
    meta.init_weights()
    whole = GPTModel.build(GPT, seed=7).state_dict()
    assert all(torch.equal(v, whole[k]) for k, v in meta.state_dict().items())
    untied = dataclasses.replace(GPT, tie_word_embeddings=False)
    assert GPTModel.build(untied, device="meta").tied_weights == {}
    with pytest.raises(ValueError, match=r"no such layers \[7\]"):
        GPTModel.build(GPT, device="meta").keep_stage([3, 7], first=True, last=True)


def _fsdp_from_meta(out: str) -> None:
    """ZeRO-3 over 2 ranks of a meta-built GPT: each rank allocates and initialises only its
    shards; gathered, they are the weights one process builds."""
    from rapidformer import RapidformerConfig, RapidformerEngine
    from rapidformer.checkpoint import gathered_model_state

    torch.set_num_threads(1)
    config = RapidformerConfig.from_dict({"lr": 1e-3, "zero_3_memory_optimization": True})
    engine = RapidformerEngine(config, builds_optimizer=True)
    state = engine.compose(GPTModel.build(GPT, device="meta", seed=7))
    local = sum(p.to_local().numel() for p in state.unwrapped_model.parameters())  # type: ignore[operator]
    full = gathered_model_state(state)
    plan = [str(step) for step in state.plan]
    if engine.env.rank == 0:
        assert full is not None
        torch.save(full, Path(out) / "gathered.pt")
    (Path(out) / f"rank_{os.environ['RANK']}.json").write_text(json.dumps([local, plan]))
    engine.close()


@pytest.mark.distributed
def test_a_meta_built_model_is_initialised_shard_by_shard_under_fsdp2(tmp_path: Path) -> None:
    run_distributed(_fsdp_from_meta, 2, str(tmp_path))
    whole = GPTModel.build(GPT, seed=7)
    gathered = torch.load(tmp_path / "gathered.pt")
    # The same draws from the same generator: bitwise the weights of the one-process build.
    assert all(torch.equal(gathered[k], v) for k, v in whole.state_dict().items())
    total = sum(p.numel() for p in whole.parameters())
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert sum(local for local, _ in ranks) == total and max(r[0] for r in ranks) < 0.6 * total
    assert any(step.startswith("materialise: meta device -> cpu") for step in ranks[0][1])
