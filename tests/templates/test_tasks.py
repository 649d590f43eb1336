"""The per-task pieces of the Finetuner: label alignment, QA windows and spans, masking,
entity extraction, padding to a bucket, and finding splits on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer.data.finetune_data import load_splits
from rapidformer.errors import ConfigError, DataError
from rapidformer.templates.tasks import (
    IGNORE_INDEX,
    MaskedLM,
    QuestionAnswering,
    Seq2SeqLM,
    SequenceClassification,
    TokenClassification,
    entities,
)
from rapidformer.templates.tasks.base import Evaluated
from rapidformer.testing.finetune import task_dataset, tiny_model


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("bert", tmp_path_factory.mktemp("bert")))


def _rows(records: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(records)


def test_entities_follow_iob_rules() -> None:
    tags = ["B-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-PER", "PER"]
    assert entities(tags) == {("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 4), ("PER", 5, 6)}
    assert entities(["O", "O"]) == set()


def test_token_labels_sit_on_each_words_first_sub_token(bert: Any) -> None:
    task = TokenClassification(bert, seq_length=32)
    words = ["the", "unseenword", "miller"]
    features = task.prepare(_rows([{"tokens": words, "tags": ["O", "B-X", "I-X"]}]), "train")
    row = features[0]
    pieces = bert.convert_ids_to_tokens(row["input_ids"])
    assert len(pieces) > len(words) + 2  # the made-up word splits into several pieces
    labelled = [(p, label) for p, label in zip(pieces, row["labels"], strict=True)]
    kept = [(p, task.labels[label]) for p, label in labelled if label != IGNORE_INDEX]  # type: ignore[index]
    assert [tag for _, tag in kept] == ["O", "B-X", "I-X"]
    assert [p for p, _ in kept][1] == pieces[2] and not pieces[2].startswith("##")
    assert features.lengths == [len(row["input_ids"])]


def test_qa_windows_overlap_and_map_answers_back_to_characters(bert: Any) -> None:
    context = " ".join(["the farmer sells the bread in the market."] * 6) + " a red kite."
    answer_start = context.index("a red kite")
    rows = _rows(
        [
            {
                "question": "what is it?",
                "context": context,
                "answers": {"text": ["a red kite"], "answer_start": [answer_start]},
            }
        ]
    )
    task = QuestionAnswering(bert, seq_length=24, doc_stride=6)
    features = task.prepare(rows, "validation")
    assert len(features) > 3  # the context needs several windows
    holding = [f for f in features.rows if f["start_positions"] > 0]
    assert holding, "some window holds the answer"
    for feature in holding:
        first = feature["offset_start"][feature["start_positions"]]
        last = feature["offset_end"][feature["end_positions"]]
        assert context[first:last] == "a red kite"
    for previous, current in zip(features.rows, features.rows[1:], strict=False):
        shared = set(previous["offset_start"]) & set(current["offset_start"]) - {-1}
        assert len(shared) >= 6 - 1  # consecutive windows share the stride's tokens
    # Scoring: the best span of each example over all its windows.
    batch = task.collate(features.rows)
    logits = torch.full(batch["input_ids"].shape, -5.0)
    start_logits, end_logits = logits.clone(), logits.clone()
    target = holding[-1]["feature_index"]
    start_logits[target, holding[-1]["start_positions"]] = 5.0
    end_logits[target, holding[-1]["end_positions"]] = 5.0

    class Model(torch.nn.Module):
        def forward(self, **_: torch.Tensor) -> Any:
            return type("Out", (), {"start_logits": start_logits, "end_logits": end_logits})

    outputs = Model()(**task.inputs(batch))
    output = task.statistics(outputs, batch, task.loss(outputs, batch))
    assert task.metrics(Evaluated([output], features, None, None)) == {
        "exact_match": 100.0,
        "f1": 100.0,
    }


def test_masked_lm_masks_a_sixth_of_the_tokens_and_fixes_validation_masks(bert: Any) -> None:
    rows = _rows([{"text": "the old miller carries a lamp near the river at night."}] * 64)
    task = MaskedLM(bert, seq_length=32, seed=3)
    train, valid = task.prepare(rows, "train"), task.prepare(rows, "validation")
    assert "labels" not in train[0] and "labels" in valid[0]
    again = MaskedLM(bert, seq_length=32, seed=3).prepare(rows, "validation")
    assert [r["input_ids"] for r in again.rows] == [r["input_ids"] for r in valid.rows]
    torch.manual_seed(0)
    batch = task.collate(train.rows)
    labels = batch["labels"]
    fraction = (labels != IGNORE_INDEX).float().sum() / (batch["attention_mask"].sum() - 128)
    assert 0.1 < fraction.item() < 0.2
    masked = batch["input_ids"] == bert.mask_token_id
    assert masked.sum() > 0.7 * (labels != IGNORE_INDEX).sum()
    assert (labels[labels != IGNORE_INDEX] != bert.mask_token_id).all()


def test_bucket_padding_gives_the_same_classification_loss(bert: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model_dir = tiny_model("bert", tmp_path / "model")
    records = [{"text": "a b " * n, "label": n % 2} for n in range(1, 9)]
    task = SequenceClassification(bert, seq_length=64)
    features = task.prepare(_rows(records), "train")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2).eval()
    batches = [task.collate(features.rows), task.collate(features.rows, pad_to=24)]
    full, bucket = (task.loss(model(**task.inputs(b)), b) for b in batches)
    assert task.collate(features.rows, pad_to=24)["input_ids"].shape == (8, 24)
    assert abs(full.item() - bucket.item()) <= 1e-5


def test_seq2seq_targets_pad_separately_from_sources(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("t5", tmp_path / "t5"))
    task = Seq2SeqLM(tokenizer, seq_length=32)
    features = task.prepare(_rows([{"source": "the farmer sells a lamp", "target": "a lamp"}]), "t")
    assert features[0]["target"][-1] == tokenizer.eos_token_id
    fixed, bucket = task.collate(features.rows), task.collate(features.rows, pad_to=8)
    assert fixed["labels"].shape == (1, 32) and bucket["labels"].shape == (1, 8)
    assert bucket["input_ids"].shape == (1, 8)


def test_splits_are_found_by_file_name_prefix_and_saved_dataset(tmp_path: Path) -> None:
    task_dataset("sequence_classification", tmp_path / "plain", train=8, validation=4)
    assert {k: len(v) for k, v in load_splits(str(tmp_path / "plain")).items()} == {
        "train": 8,
        "validation": 4,
    }
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name, count in (("sst2_train.csv", 3), ("sst2.dev.csv", 2), ("other_train.csv", 5)):
        (mixed / name).write_text("text,label\n" + "x,0\n" * count)
    splits = load_splits(str(mixed), "sst2")
    assert {k: len(v) for k, v in splits.items()} == {"train": 3, "validation": 2}
    assert len(load_splits(str(mixed), "other_train.csv")["train"]) == 5
    saved = tmp_path / "saved"
    from datasets import DatasetDict

    DatasetDict(
        {"train": _rows([{"text": "a", "label": 0}]), "dev": _rows([{"text": "b"}])}
    ).save_to_disk(str(saved / "cfg"))
    assert set(load_splits(str(saved), "cfg")) == {"train", "validation"}
    (mixed / "notes.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ConfigError, match=r"cannot tell the split of notes\.json"):
        load_splits(str(mixed))


def test_metrics_of_a_rank_without_batches_are_zeros_and_unknown_tags_name_their_row(
    bert: Any,
) -> None:
    # A rank whose share of a tiny validation split is empty still joins the all-reduce.
    task = TokenClassification(bert, seq_length=16)
    task.prepare(_rows([{"tokens": ["a", "b"], "tags": ["B-X", "O"]}]), "train")
    assert task.metrics(Evaluated([], None, None, None)) == {
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "accuracy": 0.0,
    }
    valid = _rows([{"tokens": ["a"], "tags": ["O"]}, {"tokens": ["b", "c"], "tags": ["O", "B-Y"]}])
    with pytest.raises(DataError, match=r"label 'B-Y' \(row 1\).*known labels: B-X, O"):
        task.prepare(valid, "validation")
