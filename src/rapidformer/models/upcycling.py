"""Sparse upcycling: an MoE model started from a dense one.

Every expert of an MoE layer starts as a copy of the dense FFN it replaces; the router is new.
Since a token's expert weights sum to one and all its experts are the same function, the
upcycled model computes exactly the dense model's outputs at step 0 (dropless routing), and
training then lets the experts drift apart. Two ways in: a built-in model that reaches
``compose()`` already materialised is upcycled in place, and ``--moe-use-upcycling`` with
``--load DIR`` of a dense checkpoint (or export) reads the dense weights into the MoE model and
starts a fresh run (step 0, new optimizer state).
"""

from __future__ import annotations

import torch
from torch import nn

from rapidformer.distributed.tensors import local_part
from rapidformer.models.moe import MoELayer


def upcycle_in_place(blocks: nn.ModuleDict, dense: dict[str, nn.Module], seed: int) -> None:
    """Experts = copies of the dense FFN they replace; router N(0, 0.02) from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, block in blocks.items():
            layer = block.ffn
            if not isinstance(layer, MoELayer):
                continue
            copy_dense_into_experts(layer, dense[name].state_dict())
            gate = layer.router.gate.weight
            gate.copy_(torch.randn(gate.shape, generator=generator) * 0.02)


def copy_dense_into_experts(layer: MoELayer, ffn: dict[str, torch.Tensor]) -> None:
    """Every expert of ``layer`` = the dense FFN whose state dict is ``ffn`` (fc1/fc2)."""
    experts = layer.experts
    with torch.no_grad():
        for param, value in (
            (experts.w1, ffn["fc1.weight"].t()),
            (experts.b1, ffn["fc1.bias"]),
            (experts.w2, ffn["fc2.weight"].t()),
            (experts.b2, ffn["fc2.bias"]),
        ):
            local = local_part(param)
            local.copy_(value.to(local.dtype).unsqueeze(0).expand_as(local))


def upcycled_state_dict(
    dense: dict[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """A dense built-in model's state dict in the layout of the MoE ``model``: each MoE
    layer's experts are copies of that layer's dense FFN; router entries are left out (the
    model keeps its own)."""
    out = {k: v for k, v in dense.items() if ".ffn." not in k or not _is_moe_key(k, model)}
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        prefix = name.removeprefix("_orig_mod.") + "."
        fc1w, fc1b = dense[prefix + "fc1.weight"], dense[prefix + "fc1.bias"]
        fc2w, fc2b = dense[prefix + "fc2.weight"], dense[prefix + "fc2.bias"]
        experts = module.num_experts
        out[prefix + "experts.w1"] = fc1w.t().unsqueeze(0).repeat(experts, 1, 1)
        out[prefix + "experts.b1"] = fc1b.unsqueeze(0).repeat(experts, 1)
        out[prefix + "experts.w2"] = fc2w.t().unsqueeze(0).repeat(experts, 1, 1)
        out[prefix + "experts.b2"] = fc2b.unsqueeze(0).repeat(experts, 1)
    return out


def _is_moe_key(key: str, model: nn.Module) -> bool:
    block = key.split(".ffn.")[0] + ".ffn"
    module = dict(model.named_modules()).get(block)
    return isinstance(module, MoELayer)
