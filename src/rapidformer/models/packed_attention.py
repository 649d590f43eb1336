"""Attention of packed rows that skips what the block-diagonal mask would throw away (``--packing``
on the CPU).

A packed row of ``T`` tokens under the block-diagonal mask pays a whole ``T x T`` attention
(SDPA's kernels skip no block of an explicit mask), although each token sees only the tokens of
its own sample before it. Here the row's queries are taken in blocks of :data:`QUERY_BLOCK`, and
each block attends only to the keys from the first token of the sample its first query is in
to its last query: the keys any of its queries may see. Each block's scores still go through
the mask (a block may start mid-sample and span several samples), so every token sees what it
sees under the whole mask, and the result equals that of the whole mask within rounding.

Where each sample starts is computed on the host by the collate function (``packed_starts``,
:func:`rapidformer.data.packing.collate_packed`); on the CPU reading it costs no device sync.
On a GPU the varlen kernels are the way to skip these blocks, and under ``torch.compile`` the
block bounds would be values the graph depends on: both keep SDPA with the whole mask.

The implementation is registered with transformers as :data:`NAME` and behaves as ``sdpa``
wherever it is not given ``packed_starts`` (evaluation of unpacked data, generation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAME = "rapidformer_packed"

QUERY_BLOCK = 128
"""Queries per block. Smaller blocks skip more of the keys other samples hold but call SDPA more
often; 128 was the fastest of 64, 128 and 256 on rows of 512 tokens of FLAN-like lengths
(``benchmarks/packing.py``)."""

_UNSUPPORTED = ("softcap", "s_aux", "sliding_window", "position_bias")
"""Attention options the blocked path does not apply: with any of them set, SDPA as
transformers calls it runs instead."""


def blocked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    packed_starts: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, H_kv, T, D]``, the additive mask ``[B, 1, T, T]``; returns ``[B, T, H, D]``."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    blocked = (
        packed_starts is not None
        and attention_mask is not None
        and query.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not any(kwargs.get(name) is not None for name in _UNSUPPORTED)
    )
    if not blocked:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    assert packed_starts is not None and attention_mask is not None
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    length = query.shape[2]
    # A CPU tensor the collate function filled: reading it synchronises nothing.
    firsts = packed_starts[:, ::QUERY_BLOCK].tolist()
    rows = []
    for row, starts in enumerate(firsts):
        blocks = []
        for number, first_key in enumerate(starts):
            begin, end = number * QUERY_BLOCK, min(length, (number + 1) * QUERY_BLOCK)
            blocks.append(
                F.scaled_dot_product_attention(
                    query[row : row + 1, :, begin:end],
                    key[row : row + 1, :, first_key:end],
                    value[row : row + 1, :, first_key:end],
                    attn_mask=attention_mask[row : row + 1, :, begin:end, first_key:end],
                    dropout_p=dropout,
                    scale=scaling,
                )
            )
        rows.append(torch.cat(blocks, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers' models can run (its causal
    masks, for unpacked inputs, are those of ``sdpa``); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, blocked_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def prepare_packed(model: nn.Module, device: torch.device) -> bool:
    """Check that ``model`` keeps packed samples apart (else a ConfigError naming
    ``--packing``), and switch a transformers model running ``sdpa`` on the CPU to
    :data:`NAME`; returns whether it did (the task then passes ``packed_starts``)."""
    from rapidformer.data.packing import check_packable

    check_packable(model)
    if device.type != "cpu" or _attention(model) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)  # type: ignore[operator]
    return True


def packed_attention_note(model: nn.Module) -> str:
    """How ``model`` keeps packed samples apart, for the log."""
    attention = _attention(model)
    if attention == NAME:
        return (
            f"sdpa in blocks of {QUERY_BLOCK} queries, each over its own samples' keys "
            "(the whole block-diagonal mask under torch.compile)"
        )
    return f"{attention} under a block-diagonal mask"


def _attention(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)
