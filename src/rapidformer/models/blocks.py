"""Where a model's repeated transformer blocks are: the units that recomputation, compile and
FSDP2 each treat one at a time.

Any model works, built-in or not: the blocks are found by structure (a container of modules of
one class) or, for a Hugging Face model, by the layer classes it declares unsplittable.
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: children of every ``nn.ModuleList`` or ``nn.ModuleDict``
    (the built-in models keep a dict, so that a pipeline stage holding some layers keeps their
    names) whose members all share one class (outermost containers only)."""
    blocks: list[nn.Module] = []
    taken: set[str] = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or len(module) == 0:
            continue
        children = list(module.children())
        if len({type(child) for child in children}) == 1:
            blocks.extend(children)
            taken.add(name)
    return blocks


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: a Hugging Face model's layer classes
    (``_no_split_modules``), else the repeated blocks of :func:`find_blocks`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if units:
            return units
    return find_blocks(model)
