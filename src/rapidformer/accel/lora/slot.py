"""The adapters as code that knows only the base reaches them: the frozen base's
:class:`~rapidformer.state.BaseAdditions` slot, which ``apply_lora`` puts in the train state."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rapidformer.accel.lora.aside import adapters_set_aside
from rapidformer.accel.lora.layer import ADAPTER_PARAMETER, adapted_layers, follow_tensor_parallel
from rapidformer.accel.lora.saving import save_run_adapter
from rapidformer.accel.lora.start import start_adapters
from rapidformer.config.root import RapidformerConfig
from rapidformer.state import FrozenBase


@dataclass(frozen=True)
class Adapters:
    """:class:`~rapidformer.state.BaseAdditions` for adapters (``config``: the run's flags,
    which say where their first values come from)."""

    config: RapidformerConfig

    def owns(self, name: str) -> bool:
        return ADAPTER_PARAMETER in name

    def base_only(self, module: nn.Module) -> AbstractContextManager[object]:
        return adapters_set_aside(module)

    def follow_split(self, module: nn.Module) -> None:
        for layer in adapted_layers(module).values():
            follow_tensor_parallel(layer)

    def start(self, module: nn.Module) -> None:
        start_adapters(module, self.config)

    def save(self, base: FrozenBase, full_state: Mapping[str, torch.Tensor], out_dir: Path) -> Path:
        return save_run_adapter(base, full_state, out_dir)
