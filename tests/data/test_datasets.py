"""Splits, blends and the GPT/BERT sample builders on hand-made indexed data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rapidformer.data.bert_dataset import BertDataset, bert_collate
from rapidformer.data.blended import BlendedDataset, blend_index
from rapidformer.data.gpt_dataset import GPTDataset
from rapidformer.data.indexed import IndexedDataset, IndexedDatasetBuilder
from rapidformer.data.splits import CorpusSplit, parse_data_path, parse_split, split_ranges
from rapidformer.errors import ConfigError, DataError
from rapidformer.labels import IGNORE_INDEX


def _write(prefix: Path, documents: list[list[list[int]]]) -> IndexedDataset:
    """documents -> sentences -> token ids."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for document in documents:
        for sentence in document:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


@pytest.mark.parametrize("num_documents", [1, 7, 100, 1001, 12345])
@pytest.mark.parametrize("split", ["969, 30, 1", "8,1,1", "1", "70/30", "0, 1, 0"])
def test_split_ranges_are_disjoint_cover_and_within_one_document(
    num_documents: int, split: str
) -> None:
    ranges = split_ranges(num_documents, split)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_documents
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
    for (start, end), weight in zip(ranges, parse_split(split), strict=True):
        assert abs((end - start) - weight * num_documents) <= 1


def test_bad_split_and_blend_strings_are_refused() -> None:
    for bad in ("a, b", "1, 2, 3, 4", "0, 0, 0", "-1, 2"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)
    assert parse_data_path("0.3 A 0.9 B") == [(0.25, "A"), (0.75, "B")]
    with pytest.raises(ConfigError, match="--data-path"):
        parse_data_path("0.3 A 0.7")


def test_blend_follows_the_weights_in_every_prefix() -> None:
    which, within = blend_index([0.3, 0.7], 1000)
    for n in (10, 100, 1000):
        assert abs((which[:n] == 0).sum() - 0.3 * n) <= 1
    assert list(within[which == 1][:5]) == [0, 1, 2, 3, 4]  # each dataset read in order
    blended = BlendedDataset([["a0", "a1", "a2"], ["b0", "b1", "b2", "b3"]], [0.5, 0.5], 6)
    assert [blended[i] for i in range(6)] == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_gpt_samples_cut_the_token_stream_and_cache_the_index(tmp_path: Path) -> None:
    rng = np.random.RandomState(0)
    documents = [[list(rng.randint(1, 500, size=rng.randint(5, 40)))] for _ in range(30)]
    indexed = _write(tmp_path / "gpt", documents)
    stream = {tuple(tokens) for doc in documents for tokens in doc}
    dataset = GPTDataset(
        CorpusSplit(indexed, str(tmp_path / "gpt"), "train", 0, 30, 50, 16, seed=1)
    )
    assert len(dataset) == 50 and len(list(tmp_path.glob("gpt_gpt_train_*.npy"))) == 2
    item = dataset[0]
    assert item["input_ids"].shape == (16,) and (item["input_ids"][1:] == item["labels"][:-1]).all()
    # Consecutive samples of the laid-out stream share one token; samples cover every document.
    starts = {int(dataset.shuffle[i]) for i in range(50)}
    assert len(starts) == 50
    seen = set()
    for i in range(len(dataset)):
        seen.update(dataset[i]["input_ids"].tolist())
    assert seen <= {t for tokens in stream for t in tokens}
    again = GPTDataset(CorpusSplit(indexed, str(tmp_path / "gpt"), "train", 0, 30, 50, 16, seed=1))
    assert all((again[i]["input_ids"] == dataset[i]["input_ids"]).all() for i in range(50))


def test_gpt_split_without_enough_tokens_names_the_file(tmp_path: Path) -> None:
    indexed = _write(tmp_path / "small", [[[1, 2, 3]]])
    with pytest.raises(DataError, match="small: the valid split has 3 tokens"):
        GPTDataset(CorpusSplit(indexed, str(tmp_path / "small"), "valid", 0, 1, 4, 16, seed=1))


def test_bert_samples_are_masked_sentence_pairs(tmp_path: Path) -> None:
    rng = np.random.RandomState(1)
    documents = [
        [list(rng.randint(10, 300, size=rng.randint(3, 12))) for _ in range(6)] for _ in range(20)
    ]
    indexed = _write(tmp_path / "bert", documents)
    cls, sep, mask = 2, 3, 4
    dataset = BertDataset(
        CorpusSplit(indexed, str(tmp_path / "bert"), "train", 0, 20, 200, 32, seed=5),
        cls=cls,
        sep=sep,
        mask=mask,
        vocab_size=300,
    )
    masked = predicted = swapped = 0
    for i in range(len(dataset)):
        item = dataset[i]
        ids, labels = item["input_ids"], item["mlm_labels"]
        assert ids[0] == cls and ids[-1] == sep and (ids == sep).sum() == 2
        assert len(ids) <= 32 and len(ids) <= dataset.lengths[i]
        chosen = labels != IGNORE_INDEX
        predicted += int(chosen.sum())
        masked += int((ids[chosen] == mask).sum())
        swapped += int(item["sop_label"])
        assert (labels[~chosen] == IGNORE_INDEX).all() and chosen.sum() >= 1
    tokens = sum(len(dataset[i]["input_ids"]) - 3 for i in range(len(dataset)))
    assert 0.13 < predicted / tokens < 0.17  # 15% chosen
    assert 0.7 < masked / predicted < 0.9  # 80% of those become [MASK]
    assert 0.35 < swapped / len(dataset) < 0.65  # sentence order swapped half the time
    assert (dataset[7]["input_ids"] == dataset[7]["input_ids"]).all()  # deterministic per index
    batch = bert_collate([dataset[0], dataset[1]], pad_id=0, pad_to=32)
    assert batch["input_ids"].shape == (2, 32) and batch["attention_mask"].sum() == sum(
        len(dataset[i]["input_ids"]) for i in range(2)
    )


def test_bert_needs_documents_with_two_sentences(tmp_path: Path) -> None:
    indexed = _write(tmp_path / "one", [[[5, 6, 7]], [[8, 9]]])
    with pytest.raises(DataError, match="--split-sentences"):
        BertDataset(
            CorpusSplit(indexed, str(tmp_path / "one"), "train", 0, 2, 4, 16, seed=0),
            cls=1,
            sep=2,
            mask=3,
            vocab_size=10,
        )
