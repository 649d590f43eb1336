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

from rapidformer.step_io import IGNORE_INDEX


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

    def __call__(self, rows: Sequence[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        return collate_packed(rows, self.length, self.pad_id)


def packing_note(split: str, samples: int, rows: Sequence[Mapping[str, Any]], length: int) -> str:
    tokens = sum(len(row["input_ids"]) for row in rows)
    return (
        f"{split}: {samples} samples packed into {len(rows)} rows of {length} tokens "
        f"({100 * tokens / max(1, len(rows) * length):.1f}% filled)"
    )


PACKABLE_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the block-diagonal mask as it is (tested)."""


def check_packable(model: torch.nn.Module, seq_length: int | None = None) -> None:
    """A model packed rows of ``seq_length`` tokens can run through: its forward takes
    positions, its attention reads a 4D additive mask, and no sliding window shorter than a row
    (the block-diagonal mask does not apply it). Refused otherwise (ConfigError naming
    --packing)."""
    import inspect

    from rapidformer.errors import ConfigError

    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    window = sliding_window(config)
    problem = ""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        problem = f"{type(model).__name__}'s forward takes no position_ids"
    elif attention not in PACKABLE_ATTENTION:
        problem = (
            f"{type(model).__name__} runs {attention} attention, which is not given a "
            f"block-diagonal mask here ({' and '.join(PACKABLE_ATTENTION)} are)"
        )
    elif window is not None and seq_length is not None and window < seq_length:
        problem = (
            f"{type(model).__name__} attends through a sliding window of {window} tokens, "
            f"shorter than a packed row of --seq-length {seq_length}, and the block-diagonal "
            f"mask does not apply it (or use --seq-length {window} or less)"
        )
    if problem:
        raise ConfigError.single(
            "--packing", True, f"cannot keep packed samples apart: {problem}",
            "drop --packing (samples are then padded)",
        )  # fmt: skip


def position_offset(model: torch.nn.Module) -> int:
    """What ``model`` adds to a sample's positions counted from 0: RoBERTa and its kin
    (XLM-R, CamemBERT ...) count from ``padding_idx + 1`` when they count for themselves,
    and take given ``position_ids`` as they are, so packed rows must be given positions from
    there (else every token reads another position's embedding: logits move by 0.37 on a tiny
    RoBERTa). 0 for every other model: the families that offset their own learned positions
    (OPT) do so inside, given positions or not."""
    for module in model.modules():
        padding = getattr(module, "padding_idx", None)
        counts_itself = callable(getattr(module, "create_position_ids_from_input_ids", None))
        if counts_itself and isinstance(padding, int):
            return padding + 1
    return 0


def sliding_window(config: object) -> int | None:
    """The sliding window a transformers config makes its model attend through, or None
    (Qwen2's ``sliding_window`` counts only with ``use_sliding_window``)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    return window
