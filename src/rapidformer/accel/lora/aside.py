"""Adapters set aside while code that knows only the base reshapes or fills a model.

torch's tensor-parallel styles split every parameter of the module they are given, its
children's included (an adapter's factors would be split as the weight is, which is wrong for
one of the two), and a built-in model's ``init_weights`` draws values for the parameters of the
model it was built as, and refuses any other. Both run with each adapter taken off its layer,
and the adapters are put back after: re-laid to match a split weight
(:func:`rapidformer.accel.lora.layer.follow_tensor_parallel`), or given their first values
(:func:`rapidformer.accel.lora.apply.start_adapters`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from rapidformer.accel.lora.layer import adapted_layers

_CHILDREN = ("lora_A", "lora_B", "lora_dropout")
_PARAMETERS = ("lora_magnitude_vector",)


@contextmanager
def adapters_set_aside(model: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """Within the block, ``model``'s adapted layers hold no adapter; yields them by path."""
    layers = adapted_layers(model)
    held = {
        path: (
            {name: layer._modules.pop(name) for name in _CHILDREN},
            {
                name: layer._parameters.pop(name)
                for name in _PARAMETERS
                if name in layer._parameters
            },
        )
        for path, layer in layers.items()
    }
    try:
        yield layers
    finally:
        for path, (children, parameters) in held.items():
            layer = layers[path]
            layer._modules.update(children)
            layer._parameters.update(parameters)
