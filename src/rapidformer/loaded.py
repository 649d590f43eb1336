"""``isinstance`` against a class of a package that may not be imported yet, without importing
it: a value can be an instance only once its package is loaded. torch's distributed packages
(DTensor, FSDP2, DCP, ZeroRedundancyOptimizer, pipelining) cost seconds to import, and a run
that uses none of them, or a configuration error, must not wait for them."""

from __future__ import annotations

import sys


def instance_of(value: object, module: str, name: str) -> bool:
    """Whether ``value`` is an instance of ``module.name`` (False while ``module`` is not
    imported: nothing can be one yet)."""
    package = sys.modules.get(module)
    return package is not None and isinstance(value, getattr(package, name))
