"""GPT pretraining samples: documents concatenated and cut into ``seq_length + 1`` tokens.

The documents of a split are shuffled once per epoch (seeded), their sequences laid end to end,
and the stream cut into samples that overlap by one token (the last input token of a sample is
the first of the next, so every token is predicted once). Enough epochs are laid out to give the
requested number of samples; the sample order is then shuffled once more. These two index
arrays are built with numpy and cached as ``.npy`` files next to the data, keyed by a digest of
everything that determines them, so the next run (and every other rank) loads them instead.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from rapidformer.data.indexed import IndexedDataset
from rapidformer.data.splits import CorpusSplit
from rapidformer.distributed import process_group
from rapidformer.errors import DataError


class GPTDataset(Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents
    ``[doc_start, doc_end)`` of ``indexed`` (None: one pass over them); items are
    ``{"input_ids", "labels"}``."""

    def __init__(self, split: CorpusSplit) -> None:
        indexed, prefix, name = split.indexed, split.prefix, split.name
        doc_start, doc_end, seq_length = split.doc_start, split.doc_end, split.seq_length
        num_samples, seed = split.num_samples, split.seed
        self.indexed = indexed
        self.seq_length = seq_length
        if doc_end <= doc_start:
            raise DataError(f"{prefix}: the {name} split holds no documents; adjust --split")
        first_seq, end_seq = int(indexed.doc_idx[doc_start]), int(indexed.doc_idx[doc_end])
        tokens_per_epoch = int(indexed.sizes[first_seq:end_seq].sum())
        if tokens_per_epoch <= seq_length:
            raise DataError(
                f"{prefix}: the {name} split has {tokens_per_epoch} tokens, fewer "
                f"than one sample of --seq-length {seq_length} + 1"
            )
        if num_samples is None:
            num_samples = (tokens_per_epoch - 1) // seq_length
        key = f"{name}-{doc_start}-{doc_end}-{num_samples}-{seq_length}-{seed}-{tokens_per_epoch}"
        digest = hashlib.md5(key.encode()).hexdigest()[:12]
        cache = Path(f"{prefix}_gpt_{name}_{digest}")
        self.sequences, self.shuffle = _cached_indices(
            cache,
            lambda: _build_indices(indexed, doc_start, doc_end, num_samples, seq_length, seed),
        )
        self.offsets = np.concatenate(
            [[0], np.cumsum(indexed.sizes[self.sequences], dtype=np.int64)]
        )
        self.num_samples = num_samples

    @property
    def lengths(self) -> np.ndarray:
        """Every sample is ``seq_length`` tokens long (the dynamic-shape iterator reads this)."""
        return np.full(self.num_samples, self.seq_length, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.shuffle[index]) * self.seq_length
        tokens = self._read(start, self.seq_length + 1)
        sample = torch.from_numpy(tokens.astype(np.int64))
        return {"input_ids": sample[:-1], "labels": sample[1:]}

    def _read(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the laid-out stream from token ``start``."""
        position = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces, offset = [], start - int(self.offsets[position])
        while count > 0:
            sequence = int(self.sequences[position])
            take = min(count, int(self.indexed.sizes[sequence]) - offset)
            pieces.append(self.indexed.get(sequence, offset, take))
            count -= take
            position, offset = position + 1, 0
        return np.concatenate(pieces)


def _build_indices(
    indexed: IndexedDataset,
    doc_start: int,
    doc_end: int,
    num_samples: int,
    seq_length: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    documents = np.arange(doc_start, doc_end)
    sizes = indexed.sizes
    doc_idx = indexed.doc_idx
    tokens_per_epoch = int(sizes[doc_idx[doc_start] : doc_idx[doc_end]].sum())
    # Samples overlap by one token: n samples need n * seq_length + 1 tokens.
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    order = [rng.permutation(documents) for _ in range(epochs)]
    sequences = np.concatenate(
        [np.arange(doc_idx[d], doc_idx[d + 1], dtype=np.int64) for epoch in order for d in epoch]
    )
    available = (int(sizes[sequences].sum()) - 1) // seq_length  # >= num_samples by `epochs`
    return sequences, rng.permutation(available)[:num_samples].astype(np.int64)


Indices = tuple[np.ndarray, np.ndarray]


def _cached_indices(cache: Path, build: Callable[[], Indices]) -> Indices:
    """Load the index arrays from ``cache`` or build them on rank 0 and save them atomically;
    when the data directory is read-only, every rank builds them in memory."""
    files = (Path(f"{cache}_sequences.npy"), Path(f"{cache}_shuffle.npy"))
    if process_group.rank() == 0 and not all(f.is_file() for f in files):
        arrays = build()
        try:
            for file, array in zip(files, arrays, strict=True):
                temporary = file.with_suffix(f".tmp{os.getpid()}.npy")
                np.save(temporary, array)
                os.replace(temporary, file)
        except OSError:
            pass
    process_group.barrier()
    if all(f.is_file() for f in files):
        return np.load(files[0]), np.load(files[1])
    return build()
