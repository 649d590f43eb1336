"""Padding-free packing (``--packing``): samples laid end to end in rows of ``--seq-length``
tokens, each attending only to itself.

* **Which samples share a row**: best-fit decreasing over the whole split, once (longest first;
  each goes to the row it fills best, a new row when none has room). Deterministic: the same
  rows on every run and every layout, and the sampler shuffles rows as it shuffles samples.
* **What a row holds**: each sample's tokens, its labels with its first token's cleared (that
  token would be scored from the last position of the sample before it), positions restarting
  at 0, and which sample each token belongs to.
* **What the model is given**: the positions, and a block-diagonal causal mask
  (:func:`packed_mask`) built from the sample ids the collate function computed on the host
  (:func:`collate_packed`), additive (0 where a token may attend, the dtype's lowest value
  where not): transformers' ``sdpa`` and ``eager`` attention take it as it is, fp32 and under
  autocast alike; ``eager`` misreads a boolean one. Padding at a row's end attends to the
  padding before it (a row of nothing but masked scores would be NaN). Only the ``T x T``
  expansion of the ids happens where the batch is; no boundary is inferred there.

Without the mask, attention would cross samples: position ids restarting at 0 confine it only
in flash-attention's varlen kernels (a tiny Llama's logits move by 0.61 on a CPU).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rapidformer.labels import IGNORE_INDEX


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most ``capacity`` tokens (each length must fit):
    longest first, each into the row with the least room that still takes it."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row), sorted
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"sample {index} has {length} tokens, more than a row's {capacity}")
        slot = bisect.bisect_left(room, (length, -1))
        if slot == len(room):
            rows.append([index])
            left, row = capacity - length, len(rows) - 1
        else:
            left, row = room.pop(slot)
            rows[row].append(index)
            left -= length
        bisect.insort(room, (left, row))
    return rows


def pack_rows(samples: Sequence[Mapping[str, Any]], capacity: int) -> list[dict[str, Any]]:
    """The packed rows of tokenised ``samples`` (``input_ids``, and ``labels`` where the data
    has them: chat data's; else every token is learned)."""
    packed = []
    for members in best_fit_decreasing([len(s["input_ids"]) for s in samples], capacity):
        row: dict[str, list[int]] = {
            "input_ids": [],
            "labels": [],
            "position_ids": [],
            "sample": [],
        }
        for number, index in enumerate(members):
            ids = list(samples[index]["input_ids"])
            labels = list(samples[index].get("labels", ids))
            labels[0] = IGNORE_INDEX
            row["input_ids"] += ids
            row["labels"] += labels
            row["position_ids"] += range(len(ids))
            row["sample"] += [number] * len(ids)
        packed.append(row)
    return packed


def collate_packed(rows: Sequence[Mapping[str, Any]], length: int, pad_id: int) -> dict[str, Any]:
    """Packed rows as tensors of ``length`` tokens: ``input_ids``, ``labels``, ``position_ids``,
    ``attention_mask`` (1 on real tokens: what throughput counts) and ``packed_samples`` (the
    sample each token belongs to, -1 on padding), from which :func:`packed_mask` builds the
    attention mask where the batch is."""
    count = len(rows)
    ids = torch.full((count, length), pad_id, dtype=torch.long)
    labels = torch.full((count, length), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((count, length), dtype=torch.long)
    sample = torch.full((count, length), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        positions[i, :n] = torch.tensor(row["position_ids"])
        sample[i, :n] = torch.tensor(row["sample"])
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": (sample >= 0).long(),
        "packed_samples": sample,
    }


def packed_mask(samples: torch.Tensor) -> torch.Tensor:
    """The additive block-diagonal causal mask ``[B, 1, T, T]`` of packed rows whose tokens
    belong to ``samples`` ``[B, T]`` (-1: padding, which attends to the padding before it).
    Built where the batch is, from the boundaries the collate function found on the host: a
    row of ``T`` ids crosses to the device instead of a ``T x T`` mask."""
    length = samples.shape[1]
    token = torch.arange(length, device=samples.device)
    causal = token[None, :] <= token[:, None]
    allowed = (samples[:, :, None] == samples[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, device=samples.device)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


class PackedCollate:
    """The collate function of packed rows (``pad_to`` is the dynamic-shape iterator's, which
    packing refuses: every packed row has ``length`` tokens)."""

    def __init__(self, length: int, pad_id: int) -> None:
        self.length = length
        self.pad_id = pad_id
        self.shape = f"packed rows of {length} tokens (each holds several samples)"
        """What a batch looks like, for the plan's data line."""

    def __call__(self, rows: Sequence[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        return collate_packed(rows, self.length, self.pad_id)


def packing_note(split: str, samples: int, rows: Sequence[Mapping[str, Any]], length: int) -> str:
    tokens = sum(len(row["input_ids"]) for row in rows)
    return (
        f"{split}: {samples} samples packed into {len(rows)} rows of {length} tokens "
        f"({100 * tokens / max(1, len(rows) * length):.1f}% filled)"
    )
