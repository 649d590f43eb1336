"""rapidformer: train transformers fast by flipping switches."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names load on first use (PEP 562), so that `rapidformer --help`, the config and
# the error types need no torch: importing torch alone takes seconds.
_EXPORTS = {
    "DataBundle": "rapidformer.templates",
    "Finetuner": "rapidformer.templates",
    "Pretrainer": "rapidformer.templates",
    "RapidformerConfig": "rapidformer.config",
    "RapidformerEngine": "rapidformer.engine",
    "StepFunctions": "rapidformer.step_io",
    "Trainer": "rapidformer.templates",
    "launch": "rapidformer.launcher",
    "parse_args": "rapidformer.config",
}

if TYPE_CHECKING:
    from rapidformer.config import RapidformerConfig as RapidformerConfig
    from rapidformer.config import parse_args as parse_args
    from rapidformer.engine import RapidformerEngine as RapidformerEngine
    from rapidformer.launcher import launch as launch
    from rapidformer.step_io import StepFunctions as StepFunctions
    from rapidformer.templates import DataBundle as DataBundle
    from rapidformer.templates import Finetuner as Finetuner
    from rapidformer.templates import Pretrainer as Pretrainer
    from rapidformer.templates import Trainer as Trainer

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rapidformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
