"""Adapters set aside while code that knows only the base reshapes or fills a model.

torch's tensor-parallel styles split every parameter of the module they are given, its
children's included (an adapter's factors would be split as the weight is, which is wrong for
one of the two), and a built-in model's ``init_weights`` draws values for the parameters of the
model it was built as, and refuses any other. Both run with each adapter taken off its layer,
and the adapters are put back after: re-laid to match a split weight
(:func:`rapidformer.accel.lora.layer.follow_tensor_parallel`), or given their first values
(:func:`rapidformer.accel.lora.start.start_adapters`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from rapidformer.accel.lora.layer import adapted_layers

ADDED = ("lora_A", "lora_B", "lora_dropout", "lora_magnitude_vector")
"""What an adapter adds to its layer: two child modules, a dropout, DoRA's parameter."""


@contextmanager
def adapters_set_aside(model: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """Within the block, ``model``'s adapted layers hold no adapter; yields them by path."""
    layers = adapted_layers(model)
    held: dict[str, dict[str, nn.Module | nn.Parameter]] = {}
    for path, layer in layers.items():
        held[path] = {name: getattr(layer, name) for name in ADDED if hasattr(layer, name)}
        for name in held[path]:
            delattr(layer, name)  # nn.Module's own way out of _modules / _parameters
    try:
        yield layers
    finally:
        for path, members in held.items():
            layer = layers[path]
            for name, member in members.items():
                if isinstance(member, nn.Parameter):
                    layer.register_parameter(name, member)
                else:
                    layer.add_module(name, member)
