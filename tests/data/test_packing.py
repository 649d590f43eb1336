"""Padding-free packing: a packed batch gives each sample the per-token losses and gradients it
has run alone and unpadded (within 1e-5, fp32) on a Hugging Face Llama (sdpa and eager) and
GPT-2 (learned positions), BERT and RoBERTa loaded as decoders (RoBERTa's positions count
from its padding id + 1), Gemma, Phi-3, Phi, GPT-NeoX, Falcon and OPT, under the block-diagonal
mask and through rapidformer's per-sample attention (what ``--packing`` runs on the CPU); a
sample's logits do not move when its row-mate changes; best-fit decreasing fills rows as it
should."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from rapidformer.data.packing import best_fit_decreasing, collate_packed, pack_rows, packed_mask
from rapidformer.errors import ConfigError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models import packed_attention
from rapidformer.models.packable import check_packable, position_offset
from rapidformer.templates.tasks import CausalLM

TOLERANCE = 1e-5
PER_SAMPLE = packed_attention.NAME
LENGTH = 32


ENCODERS: dict[str, Any] = {
    "bert": (transformers.BertConfig, transformers.BertLMHeadModel),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForCausalLM),  # from pad + 1
}


SMALL = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
MASKED: dict[str, Any] = {
    "gemma": lambda: transformers.GemmaConfig(
        **SMALL, intermediate_size=64, head_dim=8, num_key_value_heads=2
    ),
    "phi3": lambda: transformers.Phi3Config(**SMALL, intermediate_size=64, pad_token_id=0),
    "phi": lambda: transformers.PhiConfig(**SMALL, intermediate_size=64),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL, intermediate_size=64),
    "falcon": lambda: transformers.FalconConfig(**SMALL),
    "opt": lambda: transformers.OPTConfig(  # learned positions offset by 2 inside
        **SMALL, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64
    ),
}
"""Families that keep the block-diagonal mask (transformers' sdpa), each checked exact."""


def _model(kind: str, attention: str) -> Any:
    torch.manual_seed(0)
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif kind in MASKED:
        model = transformers.AutoModelForCausalLM.from_config(MASKED[kind]())
    elif kind in ENCODERS:  # loaded for causal LM as rapidformer loads them: as decoders
        config, head = ENCODERS[kind]
        model = head(config(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, is_decoder=True, pad_token_id=0,
        ))  # fmt: skip
    else:
        kinds = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                 "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}  # fmt: skip
        config = kinds[kind](
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
    if attention == PER_SAMPLE:
        packed_attention.register()
    model.config._attn_implementation = attention
    return model.eval()


def _samples(lengths: list[int], seed: int = 1) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 100, (n,), generator=generator).tolist()}
            for n in lengths]  # fmt: skip


def _token_losses(model: Any, ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, **inputs).logits[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


@pytest.mark.parametrize(("kind", "attention"), [("llama", "sdpa"), ("llama", "eager"),
                                                 ("gpt2", "sdpa"), ("llama", PER_SAMPLE),
                                                 ("gpt2", PER_SAMPLE), ("mistral", PER_SAMPLE),
                                                 ("qwen2", PER_SAMPLE), ("bert", "sdpa"),
                                                 ("roberta", "sdpa"), ("roberta", "eager"),
                                                 *((kind, "sdpa") for kind in MASKED)])  # fmt: skip
def test_a_packed_batch_gives_each_sample_its_own_losses_and_gradients(
    kind: str, attention: str
) -> None:
    """The model is given what the causal LM task gives it. ``PER_SAMPLE`` is given the
    sample ids and no mask: were it to fall back to sdpa, the whole row's causal mask would let
    samples see each other and the losses would move. The Llama's key and value heads are
    grouped (2 for 4 query heads). RoBERTa counts positions from its padding id + 1: given
    positions from 0, its losses would move."""
    samples = _samples([9, 14, 5, 20, 7, 11, 3])
    rows = pack_rows(samples, LENGTH)
    assert len(rows) == 3  # 69 tokens: at least three rows of 32
    batch = collate_packed(rows, LENGTH, pad_id=0)
    model = _model(kind, attention)
    task = CausalLM(SimpleNamespace(pad_token_id=0), LENGTH)  # type: ignore[arg-type]
    task.per_sample_attention = attention == PER_SAMPLE
    task.position_offset = position_offset(model)
    assert task.position_offset == (1 if kind == "roberta" else 0)  # its pad id, 0, + 1
    logits = model(**task.inputs(batch)).logits[:, :-1].float()
    if task.position_offset:  # the control: positions from 0 would move the logits
        task.position_offset = 0
        with torch.no_grad():
            unshifted = model(**task.inputs(batch)).logits[:, :-1].float()
        assert (unshifted - logits).abs().max() > 0.1
    targets = batch["labels"][:, 1:]
    packed = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    learned = targets != IGNORE_INDEX
    assert int(learned.sum()) == sum(len(s["input_ids"]) - 1 for s in samples)
    packed[learned].sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    alone = []
    for sample in samples:  # one by one, unpadded
        losses = _token_losses(model, torch.tensor([sample["input_ids"]]))
        losses.sum().backward()
        alone.append(losses[0].detach())
    # The packed losses of each sample, in the order its tokens were laid out.
    laid_out = [samples[i] for row in best_fit_decreasing([len(s["input_ids"]) for s in samples],
                                                          LENGTH) for i in row]  # fmt: skip
    assert torch.cat([alone[samples.index(s)] for s in laid_out]).shape == packed[learned].shape
    expected = torch.cat([alone[samples.index(s)] for s in laid_out])
    assert (packed[learned].detach() - expected).abs().max() <= TOLERANCE
    for grad, param in zip(packed_grads, model.parameters(), strict=True):
        assert param.grad is not None and (grad - param.grad).abs().max() <= TOLERANCE


def test_a_samples_logits_do_not_move_when_its_row_mate_changes() -> None:
    model = _model("llama", "sdpa")
    sample, short, long = _samples([12, 10, 15], seed=3)

    def logits_of_sample(mate: dict[str, list[int]], masked: bool = True) -> torch.Tensor:
        batch = collate_packed(pack_rows([sample, mate], LENGTH), LENGTH, pad_id=0)
        inputs = {"position_ids": batch["position_ids"]}
        if masked:
            inputs["attention_mask"] = packed_mask(batch["packed_samples"])
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], **inputs).logits[0]
        start = 0 if len(mate["input_ids"]) < 12 else len(mate["input_ids"])  # longest first
        return out[start : start + 12]

    with torch.no_grad():
        alone = model(input_ids=torch.tensor([sample["input_ids"]])).logits[0]
    after_short, after_long = logits_of_sample(short), logits_of_sample(long)
    assert (after_short - alone).abs().max() <= TOLERANCE
    assert (after_long - alone).abs().max() <= TOLERANCE
    # Positions restarting at 0 without the mask: the row-mate laid out first leaks in.
    assert (logits_of_sample(long, masked=False) - alone).abs().max() > 1e-2


def test_the_per_sample_attention_runs_each_sample_alone_and_is_sdpa_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the inputs ``--packing`` gives it (the mask and the sample ids), each layer calls
    SDPA once per sample (and once per row's padding), causal, with that sample's keys only and
    no mask; unpacked inputs get transformers' sdpa (one call per layer, over all the keys)."""
    model = _model("llama", PER_SAMPLE)
    samples = _samples([9, 14, 5, 20, 7, 11, 3])
    batch = collate_packed(pack_rows(samples, LENGTH), LENGTH, 0)
    calls: list[tuple[int, bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def counting(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((key.shape[2], kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    mask = packed_mask(batch["packed_samples"])
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=mask,
              position_ids=batch["position_ids"],
              packed_samples=batch["packed_samples"])  # fmt: skip
    runs = packed_attention.sample_lengths(batch["packed_samples"])
    per_layer = [(length, True, True) for row in runs for length in row]
    assert calls == per_layer * 2  # 2 layers
    assert sorted(length for row in runs for length in row[:-1]) == [3, 5, 7, 9, 11, 14, 20]
    calls.clear()
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert [keys for keys, _, _ in calls] == [LENGTH, LENGTH]


def test_best_fit_decreasing_fills_rows_tightly_and_deterministically() -> None:
    lengths = [7, 3, 5, 2, 8, 4, 1, 6]
    rows = best_fit_decreasing(lengths, 10)
    assert rows == best_fit_decreasing(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4  # 36 tokens: 4 rows of 10 is the fewest
    with pytest.raises(ValueError, match="more than a row's 10"):
        best_fit_decreasing([11], 10)


def test_only_the_tested_families_on_a_cpu_switch_to_the_per_sample_attention() -> None:
    cpu = torch.device("cpu")
    assert packed_attention.prepare_packed(_model("mistral", "sdpa"), cpu, LENGTH)
    for model, device in ((_model("qwen3", "sdpa"), cpu), (_model("llama", "eager"), cpu),
                          (_model("llama", "sdpa"), torch.device("meta"))):  # fmt: skip
        attention = model.config._attn_implementation
        assert not packed_attention.prepare_packed(model, device, LENGTH)
        assert model.config._attn_implementation == attention


def test_packing_refuses_a_model_it_cannot_keep_apart() -> None:
    model = _model("llama", "sdpa")
    check_packable(model)
    windowed = _model("mistral", "sdpa")
    windowed.config.sliding_window = 16
    check_packable(windowed, 16)
    with pytest.raises(ConfigError, match="sliding window of 16 tokens, shorter than a packed row"):
        check_packable(windowed, LENGTH)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="--packing"):
        check_packable(model)
