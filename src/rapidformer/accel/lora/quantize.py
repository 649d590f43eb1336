"""``--quantize-base nf4`` (QLoRA): the adapted layers' frozen weights stored in NF4.

torchao's ``NF4Tensor`` holds a weight in 4-bit NormalFloat codes: blocks of 64 values share a
scale, and the scales are quantised again in blocks of 256 (double quantisation), about 0.52
bytes per value. ``nn.Linear``'s own forward works on it: torchao dequantises the weight to
the input's dtype for the matmul, and its backward gives the input's gradient (the weight gets
none: it is frozen). Dequantisation happens layer by layer, so only one layer's weight is ever
whole in 16 bits.

A weight whose size is not a multiple of 64 x 256 values cannot be double-quantised, and
under ZeRO-2/3 (FSDP2 shards NF4 weights through torchao's own split) not one of 64 x 256 x
the data-parallel ranks; it stays in bf16, as do GPT-2's ``Conv1D`` layers (their matmul is
not one torchao overrides), and the plan lists them.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from rapidformer.accel.lora.layer import base_weight, is_conv1d

NF4_BLOCK = 64 * 256
"""Values per double-quantisation block: a weight's size must be a multiple of it."""


def nf4_fits(layer: nn.Module, shards: int = 1) -> bool:
    """Whether ``layer``'s weight can be stored in NF4 split over ``shards`` ranks."""
    weight = base_weight(layer)
    uneven = weight.numel() % (NF4_BLOCK * shards) or weight.shape[0] % shards
    return not uneven and not is_conv1d(layer)


def quantize_base(layers: dict[str, nn.Module], shards: int = 1) -> tuple[list[str], list[str]]:
    """Store each layer's weight in NF4 where its shape allows, in bf16 where not; returns
    (quantised paths, paths kept in bf16). ``shards``: the ranks FSDP2 will split each weight
    over (its rows, and each of the NF4 tensor's parts, must divide evenly)."""
    to_nf4 = importlib.import_module(NF4_MODULE).to_nf4

    quantised: list[str] = []
    kept: list[str] = []
    for path, layer in layers.items():
        weight = base_weight(layer).detach()
        with torch.no_grad():
            if not nf4_fits(layer, shards):
                layer.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
                kept.append(path)
                continue
            layer.weight = nn.Parameter(to_nf4(weight.to(torch.bfloat16)), requires_grad=False)
        quantised.append(path)
    return quantised, kept


def store_frozen(model: nn.Module, dtype: torch.dtype, *, linear_only: bool) -> None:
    """Store frozen floating-point parameters in ``dtype``.

    ``linear_only``: only the weights and biases of linear layers (``nn.Linear`` and its
    subclasses). Under autocast in ``dtype`` these are cast to it before every matmul anyway,
    with the same rounding, so storing them cast changes no number and halves their memory
    (LoRA under ``--precision bf16/fp16``). Otherwise every frozen parameter (QLoRA: embeddings,
    norms and the head too, as QLoRA keeps them)."""
    stored: dict[int, nn.Parameter] = {}  # a tied weight (embedding and head) stays one
    with torch.no_grad():
        for module in model.modules():
            if linear_only and not isinstance(module, nn.Linear):
                continue
            for name, parameter in list(module.named_parameters(recurse=False)):
                frozen = not parameter.requires_grad and not is_nf4(parameter)
                if frozen and parameter.is_floating_point() and parameter.dtype != dtype:
                    if id(parameter) not in stored:
                        stored[id(parameter)] = nn.Parameter(parameter.to(dtype), False)
                    setattr(module, name, stored[id(parameter)])


NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
"""Where torchao defines ``NF4Tensor``."""


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is torchao's ``NF4Tensor``, checked against the class itself where
    torchao defined it (a tensor can be one only once its module is loaded: nothing is
    imported for the check)."""
    defined = sys.modules.get(NF4_MODULE)
    return defined is not None and isinstance(tensor, defined.NF4Tensor)
