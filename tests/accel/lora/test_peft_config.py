"""PEFT's ``adapter_config.json`` is read through an allowlist: every field PEFT's ``LoraConfig``
has today is handled, changes nothing computed, or is refused by name when it asks for
something rapidformer's layer does not compute; a key a later PEFT adds is refused unless it
holds nothing."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import peft
import pytest

from rapidformer.accel.lora.peft_format import HANDLED, NEUTRAL, OFF_ONLY, settings_from
from rapidformer.errors import ConfigError

WHERE = "--lora-adapter ADAPTER"


def _as_saved(config: peft.LoraConfig) -> dict[str, Any]:
    """The config as ``adapter_config.json`` holds it (sets become lists, enums their text)."""
    values = config.to_dict()
    return json.loads(
        json.dumps(values, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    )


def _other_than(value: object) -> object:
    """A value that is not ``value`` and asks for something."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, 1]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return {"other": 1}  # None: an option switched on


def test_peft_s_defaults_are_read() -> None:
    settings = settings_from(_as_saved(peft.LoraConfig(target_modules=["q_proj"])), WHERE)
    assert (settings.shape.rank, settings.shape.alpha, settings.targets) == (8, 8.0, ("q_proj",))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(peft.LoraConfig)])
def test_every_field_of_peft_s_lora_config_is_handled_or_refused(field: str) -> None:
    saved = _as_saved(peft.LoraConfig(target_modules=["q_proj"]))
    if field in HANDLED or field in NEUTRAL:
        return  # read (tests/accel/lora/test_layer.py checks each against PEFT) or inert
    assert field in OFF_ONLY, f"PEFT's {field} is not classified: handle it or list it"
    # False is plain LoRA with a random B (kept); PiSSA initialises from the base and changes it.
    other = "pissa" if field == "init_lora_weights" else _other_than(saved.get(field))
    changed = {**saved, field: other}
    with pytest.raises(ConfigError, match=field):
        settings_from(changed, WHERE)


def test_a_key_peft_adds_later_is_refused_unless_it_holds_nothing() -> None:
    saved = _as_saved(peft.LoraConfig(target_modules=["q_proj"]))
    settings_from({**saved, "a_later_option": None}, WHERE)
    settings_from({**saved, "a_later_option": False}, WHERE)
    with pytest.raises(ConfigError, match=r"a_later_option.*does not know"):
        settings_from({**saved, "a_later_option": True}, WHERE)


@pytest.mark.parametrize(
    ("field", "value"),
    [("init_lora_weights", "pissa"), ("ensure_weight_tying", True), ("use_qalora", True)],
)
def test_options_that_change_the_layer_are_refused_by_name(field: str, value: object) -> None:
    saved = _as_saved(peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=f"{field}={value!r}"):
        settings_from({**saved, field: value}, WHERE)
