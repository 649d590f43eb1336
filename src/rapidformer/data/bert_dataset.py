"""BERT pretraining samples: sentence pairs with masked tokens and a sentence-order label.

Documents need at least two sequences (sentences, from ``rapidformer-preprocess
--split-sentences``). Consecutive sentences of a document are gathered until they reach a
target length (``seq_length - 3``; with probability ``short_seq_prob`` a random shorter one),
giving one sample. At read time the sample is cut into segments A and B at a random sentence
boundary, swapped with probability 1/2 (the sentence-order label), truncated to the target,
wrapped as ``[CLS] A [SEP] B [SEP]``, and 15% of its tokens are chosen for prediction: 80%
become ``[MASK]``, 10% a random token, 10% stay. Each sample's randomness is seeded by
``seed + index``, so the data is identical across runs, ranks and resumes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from rapidformer.data.indexed import IndexedDataset
from rapidformer.data.splits import CorpusSplit
from rapidformer.errors import DataError
from rapidformer.labels import IGNORE_INDEX


class BertDataset(Dataset):
    """Items: ``input_ids``, ``token_type_ids``, ``mlm_labels`` (-100 where nothing is
    predicted) and ``sop_label`` (1 when the segments were swapped), unpadded."""

    def __init__(
        self,
        split: CorpusSplit,
        *,
        cls: int,
        sep: int,
        mask: int,
        vocab_size: int,
        short_seq_prob: float = 0.1,
        masked_lm_prob: float = 0.15,
    ) -> None:
        indexed, seq_length, num_samples = split.indexed, split.seq_length, split.num_samples
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed = split.seed
        self.cls, self.sep, self.mask, self.vocab_size = cls, sep, mask, vocab_size
        self.masked_lm_prob = masked_lm_prob
        self.samples = _build_samples(
            indexed, split.doc_start, split.doc_end, num_samples, seq_length - 3, short_seq_prob,
            seed,
        )  # fmt: skip
        if len(self.samples) == 0:
            raise DataError(
                f"{split.prefix}: the {split.name} split has no document with two or more "
                "sentences; preprocess BERT data with --split-sentences"
            )
        self.num_samples = num_samples if num_samples is not None else len(self.samples)
        self.lengths = np.minimum(self.samples[:, 2] + 3, seq_length)
        """Upper bound of each sample's token count (the dynamic-shape iterator groups by it)."""

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.RandomState((self.seed + index) % 2**32)
        first, end, target = (int(v) for v in self.samples[index % len(self.samples)])
        sentences = [self.indexed[i].astype(np.int64) for i in range(first, end)]
        split = rng.randint(1, len(sentences))  # A gets sentences [0, split)
        a, b = np.concatenate(sentences[:split]), np.concatenate(sentences[split:])
        swapped = rng.random_sample() < 0.5
        if swapped:
            a, b = b, a
        a, b = _truncate_pair(a, b, target, rng)
        tokens = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]])
        token_types = np.concatenate([np.zeros(len(a) + 2), np.ones(len(b) + 1)])
        tokens, labels = self._mask(tokens, rng)
        return {
            "input_ids": torch.from_numpy(tokens),
            "token_type_ids": torch.from_numpy(token_types.astype(np.int64)),
            "mlm_labels": torch.from_numpy(labels),
            "sop_label": torch.tensor(int(swapped)),
        }

    def _mask(
        self, tokens: np.ndarray, rng: np.random.RandomState
    ) -> tuple[np.ndarray, np.ndarray]:
        candidates = np.flatnonzero((tokens != self.cls) & (tokens != self.sep))
        count = min(len(candidates), max(1, round(len(candidates) * self.masked_lm_prob)))
        chosen = rng.choice(candidates, size=count, replace=False)
        labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
        labels[chosen] = tokens[chosen]
        tokens = tokens.copy()
        action = rng.random_sample(count)
        tokens[chosen[action < 0.8]] = self.mask
        random_positions = chosen[(action >= 0.8) & (action < 0.9)]
        tokens[random_positions] = rng.randint(0, self.vocab_size, size=len(random_positions))
        return tokens, labels


def _truncate_pair(
    a: np.ndarray, b: np.ndarray, target: int, rng: np.random.RandomState
) -> tuple[np.ndarray, np.ndarray]:
    """Drop tokens from the front or back (at random) of the longer segment until both fit."""
    while len(a) + len(b) > target:
        if len(a) >= len(b):
            a = a[1:] if rng.random_sample() < 0.5 else a[:-1]
        else:
            b = b[1:] if rng.random_sample() < 0.5 else b[:-1]
    return a, b


def _build_samples(
    indexed: IndexedDataset,
    doc_start: int,
    doc_end: int,
    num_samples: int | None,
    max_tokens: int,
    short_seq_prob: float,
    seed: int,
) -> np.ndarray:
    """Rows ``(first sentence, end sentence, target length)``, shuffled; as many epochs over
    the documents as ``num_samples`` needs (at most 100; one when it is None)."""
    rng = np.random.RandomState(seed)
    sizes, doc_idx = indexed.sizes, indexed.doc_idx
    samples: list[tuple[int, int, int]] = []
    for _ in range(100):
        for doc in range(doc_start, doc_end):
            first, end = int(doc_idx[doc]), int(doc_idx[doc + 1])
            if end - first < 2:
                continue  # a pair needs two sentences
            samples.extend(_doc_samples(sizes, first, end, max_tokens, short_seq_prob, rng))
        if num_samples is None or len(samples) >= num_samples or not samples:
            break
    table = np.array(samples, dtype=np.int64).reshape(-1, 3)
    return table[rng.permutation(len(table))][:num_samples]


def _doc_samples(
    sizes: np.ndarray,
    first: int,
    end: int,
    max_tokens: int,
    short_seq_prob: float,
    rng: np.random.RandomState,
) -> list[tuple[int, int, int]]:
    target = rng.randint(2, max_tokens + 1) if rng.random_sample() < short_seq_prob else max_tokens
    samples, start, length = [], first, 0
    for sentence in range(first, end):
        length += int(sizes[sentence])
        last = sentence == end - 1
        if (length >= target or last) and sentence + 1 - start >= 2:
            samples.append((start, sentence + 1, target))
            start, length = sentence + 1, 0
            target = (
                rng.randint(2, max_tokens + 1)
                if rng.random_sample() < short_seq_prob
                else max_tokens
            )
    return samples


def bert_collate(
    samples: list[dict[str, torch.Tensor]], *, pad_id: int, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """Pad to ``pad_to`` (or the longest sample) and add the attention mask."""
    length = pad_to or max(len(s["input_ids"]) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((batch, length), dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    mlm_labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = sample["input_ids"]
        token_type_ids[row, :n] = sample["token_type_ids"]
        attention_mask[row, :n] = 1
        mlm_labels[row, :n] = sample["mlm_labels"]
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "mlm_labels": mlm_labels,
        "sop_label": torch.stack([s["sop_label"] for s in samples]),
    }
