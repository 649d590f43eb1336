"""What padding-free packing (``--packing``, :mod:`rapidformer.data.packing`) needs of a
model: positions it takes as given, attention that reads the block-diagonal mask, and no
sliding window shorter than a row."""

from __future__ import annotations

import inspect

import torch

from rapidformer.errors import ConfigError

PACKABLE_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the block-diagonal mask as it is (tested)."""


def check_packable(model: torch.nn.Module, seq_length: int | None = None) -> None:
    """A model packed rows of ``seq_length`` tokens can run through: its forward takes
    positions, its attention reads a 4D additive mask, and no sliding window shorter than a row
    (the block-diagonal mask does not apply it). Refused otherwise (ConfigError naming
    --packing)."""
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
