"""``--split`` and ``--data-path`` parsing: train/valid/test document ranges and weighted blends.

``--split "969, 30, 1"`` gives relative weights; they are normalised and turned into three
consecutive, disjoint document ranges that cover the corpus, each within one document of its
requested share (boundaries are rounded, then the last one is pinned to the corpus end).
A :class:`CorpusSplit` is one corpus's documents of one split: what every pretraining dataset
is built from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rapidformer.data.indexed import IndexedDataset
from rapidformer.errors import ConfigError


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969, 30, 1"`` (commas or slashes; missing entries are 0) -> normalised weights."""
    parts = [p.strip() for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError.single(
            "--split",
            split,
            "must be up to three non-negative weights "
            "with a positive sum (train, validation, test)",
            'e.g. --split "969, 30, 1"',
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    train, valid, test = (w / total for w in weights)
    return train, valid, test


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Three ``[start, end)`` document ranges for train, validation and test."""
    weights = parse_split(split)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + round(weight * num_documents))
    bounds[-1] = num_documents  # rounding must not lose or invent documents
    bounds = [min(b, num_documents) for b in bounds]
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(3)]


def parse_data_path(data_path: str) -> list[tuple[float, str]]:
    """``"PREFIX"`` -> [(1.0, PREFIX)]; ``"0.3 A 0.7 B"`` -> normalised [(0.3, A), (0.7, B)]."""
    tokens = data_path.split()
    if len(tokens) == 1:
        return [(1.0, tokens[0])]
    if len(tokens) % 2:
        raise ConfigError.single(
            "--data-path", data_path, "a blend alternates weights and prefixes", '"0.3 A 0.7 B"'
        )
    try:
        pairs = [(float(tokens[i]), tokens[i + 1]) for i in range(0, len(tokens), 2)]
    except ValueError:
        raise ConfigError.single(
            "--data-path", data_path, "a blend alternates weights and prefixes", '"0.3 A 0.7 B"'
        ) from None
    total = sum(w for w, _ in pairs)
    # float() reads "nan" and "inf" too; neither is a share of the data.
    if not math.isfinite(total) or total <= 0 or any(not w >= 0 for w, _ in pairs):
        raise ConfigError.single(
            "--data-path", data_path, "weights must be finite, >= 0, sum > 0", '"0.3 A 0.7 B"'
        )
    return [(w / total, prefix) for w, prefix in pairs]


@dataclass(frozen=True)
class CorpusSplit:
    """One corpus's documents of one split and the samples to draw from them: what every
    pretraining dataset is built from."""

    indexed: IndexedDataset
    prefix: str
    name: str
    """``train``, ``valid`` or ``test``."""
    doc_start: int
    doc_end: int
    num_samples: int | None
    """None: one pass over the split's documents."""
    seq_length: int
    seed: int
