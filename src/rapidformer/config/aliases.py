"""Other tools' spellings of one choice, mapped onto the one field that holds it.

PAI-Rapidformer named each ZeRO stage twice with a boolean flag (``--zero-2-memory-optimization``
and ``--oss-sdp-memory-optimization`` are one thing), Megatron switches whole-layer
recomputation on with ``--checkpoint-activations``, and ``--mixed-precision`` is fp16. Each of
these is kept as an *alias*: a boolean flag (and YAML key) that sets a typed field of the
schema to one value. The config itself holds only the typed field (``memory.sharding``,
``memory.recompute_granularity``, ``precision.precision``), so no code asks which spelling a user
typed, and ``to_dict`` writes the typed field only.

Aliases are resolved per source (a ``--config`` file, the command line, a dict), before sources
are merged, so that a flag on the command line overrides a file whichever spelling either used.
Within one source, two spellings that mean different values are refused, naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidformer.config.fields import all_fields
from rapidformer.errors import Violation


@dataclass(frozen=True)
class Alias:
    """A boolean flag that, when true, sets ``target`` to ``value``."""

    name: str
    """Field-style name (``zero_2_memory_optimization``), also its YAML key."""
    target: str
    """The schema field it sets (``sharding``)."""
    value: str
    """The value it sets (``zero2``)."""
    origin: str
    """Whose spelling it is, for the docs and ``--help``."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def meaning(self) -> str:
        """``--sharding zero2``: what the alias stands for."""
        return f"--{self.target.replace('_', '-')} {self.value}"


ALIASES: tuple[Alias, ...] = (
    Alias("oss_memory_optimization", "sharding", "zero1", "PAI-Rapidformer (OSS)"),
    Alias("zero_1_memory_optimization", "sharding", "zero1", "PAI-Rapidformer"),
    Alias("oss_sdp_memory_optimization", "sharding", "zero2", "PAI-Rapidformer (SDP)"),
    Alias("zero_2_memory_optimization", "sharding", "zero2", "PAI-Rapidformer"),
    Alias("fsdp_memory_optimization", "sharding", "zero3", "PAI-Rapidformer (FSDP)"),
    Alias("zero_3_memory_optimization", "sharding", "zero3", "PAI-Rapidformer"),
    Alias("checkpoint_activations", "recompute_granularity", "full", "Megatron, PAI-Rapidformer"),
    Alias("mixed_precision", "precision", "fp16", "PAI-Rapidformer"),
)
"""Every alias, in documentation order."""

BY_NAME: dict[str, Alias] = {alias.name: alias for alias in ALIASES}
"""Aliases keyed by field-style name."""

_TARGETS = frozenset(alias.target for alias in ALIASES)


def spellings(target: str, value: object) -> str:
    """How a typed value can be written: ``--sharding zero2`` plus its aliases, e.g.
    ``--sharding zero2 (--zero-2-memory-optimization, --oss-sdp-memory-optimization)``."""
    names = [a.flag for a in ALIASES if a.target == target and a.value == value]
    canonical = f"--{target.replace('_', '-')} {value}"
    return canonical + (f" ({', '.join(names)})" if names else "")


def resolve(values: dict[str, object]) -> tuple[dict[str, object], list[Violation]]:
    """``values`` (flat: field or flag names) with every alias replaced by the field it sets.

    An alias that is false sets nothing (older checkpoints store every one of them). One that is
    true overrides its field's default (an older checkpoint of an fp16 run stores
    ``precision: fp32`` beside ``mixed_precision: true``), and is refused where the field, or
    another alias, chose a different value in the same source."""
    resolved: dict[str, object] = {}
    chosen: dict[str, tuple[str, object]] = {}  # target -> (the spelling that chose, value)
    defaults = {spec.name: spec.default for spec in all_fields()}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in BY_NAME:
            resolved[key] = raw
            if name in _TARGETS and raw != defaults[name]:
                chosen[name] = (f"--{key.replace('_', '-')} {raw}", raw)
    violations: list[Violation] = []
    for key, raw in values.items():
        alias = BY_NAME.get(key.replace("-", "_"))
        if alias is None:
            continue
        on = _boolean(raw)
        if on is None:
            violations.append(Violation(alias.flag, raw, "must be true or false", "use true"))
            continue
        if not on:
            continue
        spelling, value = chosen.setdefault(alias.target, (alias.flag, alias.value))
        if value != alias.value:
            violations.append(
                Violation(
                    alias.flag,
                    True,
                    f"means {alias.meaning}, which contradicts {spelling}",
                    "keep one of them",
                )
            )
            continue
        resolved.pop(alias.target.replace("_", "-"), None)  # its default, in flag spelling
        resolved[alias.target] = alias.value
    return resolved, violations


def turned_off(values: dict[str, object], current: dict[str, object]) -> dict[str, object]:
    """The fields that aliases given as false turn off in ``current`` (a flat config): each
    returns to its default where it holds the alias's value (``cfg.replace(mixed_precision=
    False)`` on an fp16 config is fp32 again). Only a change of a config reads a false alias
    so; a loaded dict ignores it (older checkpoints store every alias, most of them false)."""
    defaults = {spec.name: spec.default for spec in all_fields()}
    off: dict[str, object] = {}
    for key, raw in values.items():
        alias = BY_NAME.get(key.replace("-", "_"))
        if alias is not None and _boolean(raw) is False and current[alias.target] == alias.value:
            off[alias.target] = defaults[alias.target]
    return off


def _boolean(raw: object) -> bool | None:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return None
