"""Attention of packed rows, one sample at a time (``--packing`` on the CPU).

Under the block-diagonal mask, SDPA computes every score of a packed row: ``T x T`` for a row of
``T`` tokens, although each token sees only the tokens of its own sample before it. Here each
row's queries, keys and values are split into its samples (``Tensor.split``: views, whose
gradient is one ``cat``), and each sample runs causal SDPA with no mask, which on the CPU is the
flash kernel that skips the blocks above the diagonal. A sample of ``L`` tokens costs ``L x L / 2``
scores instead of its share of the row's ``T x T``. Each token sees exactly what it sees under
the whole mask (padding at a row's end attends to the padding before it, as there), so the
result equals the mask's within rounding (``tests/data/test_packing.py``).

Where the samples start is the ``packed_samples`` ids the collate function computed on the host
(:func:`rapidformer.data.packing.collate_packed`); on the CPU reading them syncs nothing. On a GPU
the varlen kernels are the way to skip these scores, and under ``torch.compile`` the sample
lengths would be values the graph depends on (one graph per mix of lengths): both keep SDPA over
the whole mask, which the task passes too.

The row is split, not sliced: the gradient of a slice is a zeroed tensor of the whole row, and
``split``'s is one ``cat`` of the pieces.

The implementation is registered with transformers as :data:`NAME` and is transformers' ``sdpa``
wherever it is not given ``packed_samples`` (unpacked data, generation) or cannot apply.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidformer.models.packable import check_packable, position_offset

NAME = "rapidformer_packed"

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
"""The model types switched to :data:`NAME` (each tested against its samples run alone): their
attention is plain causal softmax attention over rotary or learned positions. Others keep
``sdpa`` over the whole mask: a family may build its own mask in its layers, pass sinks or
sparse indices, or widen its queries beyond its values."""

_KNOWN = frozenset({"position_ids", "use_cache", "cache_position", "sliding_window"})
"""The options these families pass to their attention that the per-sample path applies or may
ignore (the window only where it is at least the row, :func:`_applies`). Given any other
option, transformers' ``sdpa`` over the whole mask runs instead."""


def per_sample_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    packed_samples: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, H_kv, T, D]``, the additive mask ``[B, 1, T, T]`` (used only where this falls back
    to ``sdpa``); returns ``[B, T, H, D_v]``. Causal, as the packed mask is."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if packed_samples is None or not _applies(query, key, packed_samples, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    outputs = []
    for lengths, *row in zip(sample_lengths(packed_samples), query, key, value, strict=True):
        queries, keys, values = (part.split(lengths, dim=1) for part in row)
        outputs += [
            # [None]: the CPU's flash kernel takes 4-D inputs only (3-D ones run the math path)
            F.scaled_dot_product_attention(
                q[None], k[None], v[None], dropout_p=dropout, is_causal=True, scale=scaling
            )[0].transpose(0, 1)  # [L, H, D]: the kernel's own layout, so no copy
            for q, k, v in zip(queries, keys, values, strict=True)
        ]
    batch, heads, length = query.shape[:3]
    return torch.cat(outputs).view(batch, length, heads, value.shape[-1]), None  # one copy


def sample_lengths(samples: torch.Tensor) -> list[list[int]]:
    """The lengths of the runs of equal ids in each packed row of ``samples`` ``[B, T]`` (a
    sample's tokens, or the row's padding). A host read inside the step, which is why the path
    runs only where ``samples`` is a CPU tensor the collate function filled (no device to wait
    for); redone per layer, as a tensor is all a compiled block may be given, at about 15 us."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in samples]


def _applies(
    query: torch.Tensor, key: torch.Tensor, samples: torch.Tensor, options: dict[str, Any]
) -> bool:
    length = query.shape[2]
    window = options.get("sliding_window")
    return (
        query.device.type == "cpu"
        and samples.device.type == "cpu"
        # Compiled or traced (ONNX export), the lengths would be fixed in the graph.
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and key.shape[2] == length == samples.shape[1]  # no cache: the row's own keys
        and (window is None or window >= length)  # a window as long as the row changes nothing
        and all(name in _KNOWN or value is None for name, value in options.items())
    )


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers' models can run (its masks,
    for unpacked inputs, are those of ``sdpa``); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, per_sample_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def prepare_packed(model: nn.Module, device: torch.device, seq_length: int | None = None) -> bool:
    """Check that ``model`` keeps packed rows of ``seq_length`` tokens apart (else a
    ConfigError naming ``--packing``), and switch a transformers model of :data:`FAMILIES`
    running ``sdpa`` on the CPU to :data:`NAME`; returns whether it did (the task then passes
    ``packed_samples``)."""

    check_packable(model, seq_length)
    family = getattr(getattr(model, "config", None), "model_type", None)
    if device.type != "cpu" or _attention(model) != "sdpa" or family not in FAMILIES:
        return False
    register()
    model.set_attn_implementation(NAME)  # type: ignore[operator]
    # A model outside transformers' attention interface keeps its own (with a warning).
    return _attention(model) == NAME


def packed_attention_note(model: nn.Module) -> str:
    """How ``model`` keeps packed samples apart, and where their positions start, for the log."""

    attention = _attention(model)
    how = f"{attention} under a block-diagonal mask"
    if attention == NAME:
        how = "causal sdpa per sample (the whole block-diagonal mask under torch.compile)"
    offset = position_offset(model)
    if offset:
        how += f"; each sample's positions from {offset}, where {type(model).__name__} counts"
    return how


def _attention(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)
