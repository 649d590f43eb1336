"""The adapters a run trains: from the flags, or from ``--lora-adapter``'s directory."""

from __future__ import annotations

from dataclasses import replace

from rapidformer.accel.lora.layer import AdapterShape
from rapidformer.accel.lora.peft_format import AdapterSettings, read_settings
from rapidformer.accel.lora.targets import ALL_LINEAR
from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import ConfigError


def settings_of(config: RapidformerConfig) -> AdapterSettings:
    """The adapters this run trains: from ``--lora-adapter``'s directory when given, else from
    the flags. An adapter is trained as it was made: a flag that would change what it computes
    is refused (its dropout, a training choice, may be set)."""
    adapters = config.adapters
    if adapters.lora_adapter is None:
        assert adapters.lora_rank is not None
        rank = adapters.lora_rank
        alpha = adapters.lora_alpha if adapters.lora_alpha is not None else 2.0 * rank
        shape = AdapterShape(
            rank, alpha, adapters.lora_variant or "lora", adapters.lora_dropout or 0.0
        )
        return AdapterSettings(
            shape,
            targets=adapters.lora_target_modules or ALL_LINEAR,
            base=config.model.pretrained_model_name_or_path,
        )
    saved = read_settings(adapters.lora_adapter)
    given = {
        "--lora-rank": (adapters.lora_rank, saved.shape.rank),
        "--lora-alpha": (adapters.lora_alpha, saved.shape.alpha),
        "--lora-variant": (adapters.lora_variant, saved.shape.variant),
        "--lora-target-modules": (adapters.lora_target_modules, None),
        "--lora-modules-to-save": (adapters.lora_modules_to_save, None),
    }
    for flag, (value, theirs) in given.items():
        if value is not None and value != theirs:
            said = f" ({theirs})" if theirs is not None else ""
            raise ConfigError.single(
                flag, value,
                f"cannot change the adapter in {adapters.lora_adapter}{said}: a run that starts "
                "from an adapter trains it as it was made",
                f"drop {flag}",
            )  # fmt: skip
    dropout = saved.shape.dropout if adapters.lora_dropout is None else adapters.lora_dropout
    base = config.model.pretrained_model_name_or_path or saved.base
    return replace(saved, shape=replace(saved.shape, dropout=dropout), base=base)
