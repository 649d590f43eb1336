"""The Pretrainer's model families: the registry, each family's loss and metrics on batches
whose values are known by hand, and a family added by registration alone driving a Pretrainer."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from rapidformer import parse_args
from rapidformer.data.gpt_dataset import GPTDataset
from rapidformer.data.tokenizers import TOKENIZER_TYPES, RapidTokenizer
from rapidformer.errors import ConfigError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import ModelInputs
from rapidformer.templates.families import (
    FAMILIES,
    CorpusSplit,
    PretrainFamily,
    family_for,
    model_shape,
)
from rapidformer.templates.pretrainer import Pretrainer, build_pretraining_model, model_family
from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents
from tests.helpers.trainers import read_losses

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
SHAPE += ["--seq-length", "16", "--lr", "1e-3"]


def test_the_registry_lists_gpt_and_bert_and_each_tokenizer_selects_one() -> None:
    assert list(FAMILIES) == ["gpt", "bert"]
    chosen = {kind: family_for(kind).name for kind in TOKENIZER_TYPES}
    assert chosen == {
        "BertWordPieceLowerCase": "bert",
        "BertWordPieceCase": "bert",
        "GPT2BPETokenizer": "gpt",
    }
    config = parse_args(["--tokenizer-type", "BertWordPieceCase", "--lr", "1e-3"])
    assert model_family(config) == "bert"


def test_an_unknown_tokenizer_type_is_a_config_error_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        family_for("SentencePiece")
    (violation,) = raised.value.violations
    assert (violation.flag, violation.value) == ("--tokenizer-type", "SentencePiece")
    assert violation.rule == (
        "must be one of GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase"
    )


def test_only_the_gpt_family_asks_for_a_merge_file() -> None:
    gpt = parse_args(["--tokenizer-type", "GPT2BPETokenizer", "--lr", "1e-3"])
    bert = parse_args(["--tokenizer-type", "BertWordPieceCase", "--lr", "1e-3"])
    assert [v.flag for v in FAMILIES["gpt"].config_violations(gpt)] == ["--merge-file"]
    assert FAMILIES["bert"].config_violations(bert) == []


def test_the_gpt_family_builds_the_model_the_flags_describe() -> None:
    config = parse_args(["--tokenizer-type", "GPT2BPETokenizer", *SHAPE, "--seed", "3"])
    built = build_pretraining_model(config, vocab_size=50)
    direct = GPTModel.build(
        GPTConfig(50, 2, 32, 4, max_position_embeddings=16, dropout=config.model.hidden_dropout),
        seed=3,
    )
    assert model_shape(config, 50)["max_position_embeddings"] == 16  # --seq-length's default
    assert isinstance(built, GPTModel) and built.config == direct.config
    theirs = direct.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in built.state_dict().items())


def test_gpt_loss_and_weight_on_uniform_logits() -> None:
    gpt, vocab = FAMILIES["gpt"], 10
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.ones(2, 3).long()}
    assert gpt.inputs(batch)[0] is batch["input_ids"]  # type: ignore[index]
    assert gpt.loss(torch.zeros(2, 3, vocab), batch).item() == pytest.approx(math.log(vocab))
    assert gpt.weight(batch) == 6


def test_bert_loss_weight_and_accuracies_count_only_the_masked_tokens() -> None:
    bert, vocab = FAMILIES["bert"], 8
    labels = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX], [5, IGNORE_INDEX, 1]])
    batch = {"mlm_labels": labels, "sop_label": torch.tensor([0, 1])}
    uniform = (torch.zeros(2, 3, vocab), torch.zeros(2, 2))
    # Uniform logits: ln(vocab) for the masked tokens plus ln(2) for the sentence order.
    expected = math.log(vocab) + math.log(2)
    assert bert.loss(uniform, batch).item() == pytest.approx(expected)
    assert int(bert.weight(batch)) == 3
    mlm = torch.zeros(2, 3, vocab)
    mlm[0, 1, 3] = mlm[1, 0, 5] = 1.0  # two of the three masked tokens right; [1, 2] wrong
    sop = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # first sample right, second wrong
    stats = {key: int(v) for key, v in bert.statistics((mlm, sop), batch).items()}
    assert stats == {"num_tokens": 3, "mlm_correct": 2, "sop_correct": 1, "samples": 2}
    metrics = bert.metrics([stats, stats], None, None)
    assert metrics == {"mlm_accuracy": pytest.approx(2 / 3), "sop_accuracy": 0.5}


class _Unigram(nn.Module):
    """Next-token logits from the current token alone; starts at zero (uniform logits)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.config = f"unigram over {vocab_size} tokens"  # the Pretrainer logs a model's config
        self.table = nn.Embedding(vocab_size, vocab_size)
        nn.init.zeros_(self.table.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


class _TinyFamily(PretrainFamily):
    """A third family known only to this test; records which of its hooks ran."""

    name = "tiny"
    tokenizer_types = ("GPT2BPETokenizer",)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def build_model(self, config: Any, vocab_size: int, device: str) -> nn.Module:
        self.calls.append("build_model")
        return _Unigram(vocab_size)

    def dataset(self, split: CorpusSplit, tokenizer: RapidTokenizer) -> Dataset:
        self.calls.append("dataset")
        return GPTDataset(split)

    def collate(self, tokenizer: RapidTokenizer, seq_length: int | None) -> Callable[..., Any]:
        return default_collate

    def inputs(self, batch: Any) -> ModelInputs:
        return (batch["input_ids"],)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        self.calls.append("loss")
        logits = outputs.flatten(0, 1)
        return nn.functional.cross_entropy(logits, batch["labels"].flatten())

    def weight(self, batch: Any) -> int | torch.Tensor:
        return int(batch["labels"].numel())

    def statistics(self, outputs: Any, batch: Any) -> dict[str, Any]:
        return {"samples": torch.tensor(batch["labels"].shape[0])}

    def metrics(
        self, outputs: list[Mapping[str, Any]], device: torch.device | None, group: Any
    ) -> dict[str, float]:
        return {"evaluated_samples": float(sum(int(o["samples"]) for o in outputs))}


def test_a_family_added_to_the_registry_drives_the_pretrainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = build_pretraining_data(
        tmp_path / "data", "GPT2BPETokenizer", synthetic_documents(60, seed=0), vocab_size=300
    )
    tiny = _TinyFamily()
    monkeypatch.delitem(FAMILIES, "gpt")
    monkeypatch.setitem(FAMILIES, "tiny", tiny)
    flags = ["--train-iters", "2", "--micro-batch-size", "2", "--eval-iters", "3"]
    flags += ["--log-interval", "1", "--save", str(tmp_path / "run")]
    trainer = Pretrainer(parse_args([*data.flags(), *SHAPE, *flags]))
    try:
        metrics = trainer.fit()
    finally:
        trainer.engine.close()
    assert trainer.family == "tiny" and trainer.pretrain_family is tiny
    assert {"build_model", "dataset", "loss"} <= set(tiny.calls)
    # Zero logits are uniform: the first step's loss is ln(vocabulary), exactly as computed by
    # the family's loss; after one update it is lower.
    losses = read_losses(tmp_path / "run")
    assert losses[1] == pytest.approx(math.log(trainer.tokenizer.vocab_size), abs=1e-6)
    assert losses[2] < losses[1]
    # The family's statistics reached its metrics: 3 validation batches of 2 samples.
    assert metrics["evaluated_samples"] == 6.0
