"""Hugging Face conversion: logits parity both ways, strict state-dict mapping, export/load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from rapidformer.models import (
    BertConfig,
    BertModel,
    GPTConfig,
    GPTModel,
    bert_from_hf,
    bert_to_hf,
    export_hugging_face,
    gpt_from_hf,
    gpt_to_hf,
    hf_config_for,
    load_hugging_face,
)
from tests.helpers.models import MODEL_SHAPE

transformers = pytest.importorskip("transformers")

GPT_CONFIG = GPTConfig(**MODEL_SHAPE, dropout=0.0)
BERT_CONFIG = BertConfig(**MODEL_SHAPE, dropout=0.0)
ATOL = 1e-5


def perturb(model: nn.Module, seed: int) -> None:
    """Move every parameter off its init (biases 0, LayerNorm 1) so a mix-up would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, 16), generator=generator)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    token_types = (torch.arange(16) >= 6).long().expand(3, -1).clone()
    return ids, mask, token_types


@pytest.fixture(scope="module")
def hf_gpt() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=100,
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    perturb(model, 1)
    return model


@pytest.fixture(scope="module")
def hf_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=100,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).eval()
    perturb(model, 2)
    return model


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_gpt_from_hf_gives_the_same_logits(hf_gpt: nn.Module) -> None:
    model = GPTModel.build(GPT_CONFIG)
    model.load_state_dict(gpt_from_hf(hf_gpt.state_dict(), GPT_CONFIG), strict=True)
    model.eval()
    assert count(model) == count(hf_gpt)
    ids, mask, _ = batch()
    with torch.no_grad():
        theirs = hf_gpt(ids, attention_mask=mask).logits
        ours = model(ids, attention_mask=mask)
    real = mask.bool()  # right padding: real tokens' logits do not depend on it
    assert (ours[real] - theirs[real]).abs().max().item() <= ATOL
    # A bare GPT2Model state dict (no "transformer." prefix, no lm_head) converts too.
    bare = {k.removeprefix("transformer."): v for k, v in hf_gpt.state_dict().items()}
    del bare["lm_head.weight"]
    converted = gpt_from_hf(bare, GPT_CONFIG)
    assert all(torch.equal(converted[k], v) for k, v in model.state_dict().items())


def test_gpt_export_gives_the_same_logits(tmp_path: Path) -> None:
    model = GPTModel.build(GPT_CONFIG, seed=5)
    perturb(model, 3)
    model.eval()
    export_hugging_face(model, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["activation_function"] == "gelu_new" and hf_config["n_inner"] == 128
    # Exports carry no pickle: safetensors only.
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "GPT2LMHeadModel" and count(loaded) == count(model)
    ids, mask, _ = batch()
    with torch.no_grad():
        theirs = loaded.eval()(ids, attention_mask=mask).logits
        ours = model(ids)
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() <= ATOL
    back = load_hugging_face(tmp_path)
    assert isinstance(back, GPTModel) and back.config == GPT_CONFIG
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_bert_from_hf_gives_the_same_logits(hf_bert: nn.Module) -> None:
    model = BertModel.build(BERT_CONFIG)
    model.load_state_dict(bert_from_hf(hf_bert.state_dict(), BERT_CONFIG), strict=True)
    model.eval()
    assert count(model) == count(hf_bert)
    ids, mask, token_types = batch()
    with torch.no_grad():
        theirs = hf_bert(ids, attention_mask=mask, token_type_ids=token_types)
        mlm, sop = model(ids, token_types, mask)
    assert (mlm - theirs.prediction_logits).abs().max().item() <= ATOL
    assert (sop - theirs.seq_relationship_logits).abs().max().item() <= ATOL


def test_bert_export_gives_the_same_logits(tmp_path: Path) -> None:
    model = BertModel.build(BERT_CONFIG, seed=5)
    perturb(model, 4)
    model.eval()
    export_hugging_face(model, tmp_path)
    loaded = transformers.AutoModelForPreTraining.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "BertForPreTraining" and count(loaded) == count(model)
    ids, mask, token_types = batch()
    with torch.no_grad():
        theirs = loaded.eval()(ids, attention_mask=mask, token_type_ids=token_types)
        mlm, sop = model(ids, token_types, mask)
    assert (mlm - theirs.prediction_logits).abs().max().item() <= ATOL
    assert (sop - theirs.seq_relationship_logits).abs().max().item() <= ATOL
    back = load_hugging_face(tmp_path)
    assert isinstance(back, BertModel) and back.config == BERT_CONFIG
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_state_dict_round_trip(tied: bool) -> None:
    config = dataclasses.replace(GPT_CONFIG, tie_word_embeddings=tied)
    model = GPTModel.build(config, seed=7)
    perturb(model, 5)
    hf_state = gpt_to_hf(model)
    with torch.random.fork_rng():
        reference = transformers.GPT2LMHeadModel(hf_config_for(model))
    assert set(hf_state) == set(reference.state_dict())
    assert all(v.shape == reference.state_dict()[k].shape for k, v in hf_state.items())
    back = gpt_from_hf(hf_state, config)
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_bert_state_dict_round_trip() -> None:
    model = BertModel.build(BERT_CONFIG, seed=7)
    perturb(model, 6)
    back = bert_from_hf(bert_to_hf(model), BERT_CONFIG)
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_conversion_is_strict(hf_gpt: nn.Module, hf_bert: nn.Module) -> None:
    state = dict(hf_gpt.state_dict())
    state["transformer.h.0.attn.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected keys"):
        gpt_from_hf(state, GPT_CONFIG)
    state = dict(hf_gpt.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match=r"c_fc\.bias"):
        gpt_from_hf(state, GPT_CONFIG)
    state = dict(hf_bert.state_dict())
    state["cls.predictions.decoder.weight"] = torch.zeros(100, 32)
    with pytest.raises(ValueError, match="decoder differs"):
        bert_from_hf(state, BERT_CONFIG)


def test_export_saves_the_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "hello": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", mask_token="[MASK]"
    )
    export_hugging_face(BertModel.build(BERT_CONFIG), tmp_path, tokenizer=tokenizer)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("hello there")["input_ids"] == [5, 1]
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == 0


def test_load_refuses_an_unsupported_config(tmp_path: Path) -> None:
    config = transformers.GPT2Config(
        vocab_size=100,
        n_layer=1,
        n_embd=32,
        n_head=4,
        n_positions=16,
        activation_function="relu",
        bos_token_id=None,
        eos_token_id=None,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation_function"):
        load_hugging_face(tmp_path)
