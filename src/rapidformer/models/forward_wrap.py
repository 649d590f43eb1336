"""Replacing a module's ``forward`` without tying the module to itself.

Several switches wrap a module's forward on the instance (autocast around the model,
recomputation around each layer, the fused LM loss around a Hugging Face model). The natural
way, a closure over ``module.forward`` stored back on the module, is a reference cycle: the
bound method references the module, the module its new forward. A module in a cycle is freed
only when Python's cycle collector next runs, not when the last user reference goes; on a GPU
a closed engine's model would still hold its device memory while the next one is built, and
the next run's peak would count the previous one's parameters.

:func:`current_forward` gives the forward to wrap, reaching the module through a weak
reference, so that nothing the module holds leads back to it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn


def current_forward(module: nn.Module) -> Callable[..., Any]:
    """What ``module(...)`` runs now, as a function that does not keep ``module`` alive.

    A forward already set on the instance is returned as it is (ours are cycle-free), unless it
    is one of the module's own bound methods, which is re-bound weakly like the class's."""
    bound: Any = module.__dict__.get("forward") or module.forward
    if not (inspect.ismethod(bound) and bound.__self__ is module):
        return bound  # set on the instance (by us: cycle-free), or not a method of it
    function = bound.__func__
    owner = owner_of(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return function(owner(), *args, **kwargs)

    # What inspect.signature(module.forward) gave before (callers read parameter names).
    forward.__signature__ = inspect.signature(bound)  # type: ignore[attr-defined]
    forward.__name__ = function.__name__
    forward.__qualname__ = function.__qualname__
    forward.__doc__ = function.__doc__
    return forward


def owner_of(module: nn.Module) -> Callable[[], nn.Module]:
    """A weak reference to ``module`` for a replacement forward that needs the module itself
    (its ``training`` flag): calling it gives the module."""
    reference = weakref.ref(module)
    name = type(module).__name__  # not the module: the closure must not reference it

    def get() -> nn.Module:
        target = reference()
        if target is None:
            raise ReferenceError(f"the {name} this forward served no longer exists")
        return target

    return get
