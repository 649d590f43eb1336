"""The whole configuration, one section per concern, and its conversion to and from dicts.

:class:`RapidformerConfig` holds one frozen dataclass of :mod:`rapidformer.config.schema` per
section. ``from_dict`` accepts nested (``{section: {field: value}}``) or flat dicts keyed by
field or flag name (aliases included), checks every name and type and reports every problem
at once; ``to_dict`` writes the nested form back (checkpoints store it), typed fields only.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from rapidformer.config import aliases, schema
from rapidformer.config.fields import FieldSpec, all_fields, fields_by_name
from rapidformer.config.schema import SECTIONS
from rapidformer.errors import ConfigError, Violation


@dataclass(frozen=True, kw_only=True)
class RapidformerConfig:
    """Everything a run needs, one section per concern.

    Build it from flags with :func:`rapidformer.parse_args`, from a dict or YAML with
    :meth:`from_dict`, or directly: ``RapidformerConfig(data=DataConfig(micro_batch_size=8))``.
    """

    data: schema.DataConfig = field(default_factory=schema.DataConfig)
    model: schema.ModelConfig = field(default_factory=schema.ModelConfig)
    training: schema.TrainingConfig = field(default_factory=schema.TrainingConfig)
    precision: schema.PrecisionConfig = field(default_factory=schema.PrecisionConfig)
    parallel: schema.ParallelConfig = field(default_factory=schema.ParallelConfig)
    memory: schema.MemoryConfig = field(default_factory=schema.MemoryConfig)
    moe: schema.MoEConfig = field(default_factory=schema.MoEConfig)
    graph: schema.GraphConfig = field(default_factory=schema.GraphConfig)
    adapters: schema.AdapterConfig = field(default_factory=schema.AdapterConfig)
    optimizer: schema.OptimizerConfig = field(default_factory=schema.OptimizerConfig)
    checkpoint: schema.CheckpointConfig = field(default_factory=schema.CheckpointConfig)
    logging: schema.LoggingConfig = field(default_factory=schema.LoggingConfig)
    planning: schema.PlanningConfig = field(default_factory=schema.PlanningConfig)

    def to_dict(self) -> dict[str, dict[str, object]]:
        """Nested plain dict ``{section: {field: value}}``; :meth:`from_dict` inverts it."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> RapidformerConfig:
        """Build from a nested dict (as :meth:`to_dict` writes) or a flat one keyed by field
        or flag name (``micro_batch_size`` or ``micro-batch-size``)."""
        return config_from_dict(values)

    def replace(self, **flat: object) -> RapidformerConfig:
        """A copy with some fields changed, named flat: ``cfg.replace(micro_batch_size=4)``
        (an alias too: ``cfg.replace(zero_2_memory_optimization=True)``)."""
        merged: dict[str, object] = {
            name: value for section in self.to_dict().values() for name, value in section.items()
        }
        merged.update(aliases.turned_off(flat, merged))
        changes, violations = aliases.resolve(flat)
        if violations:
            raise ConfigError(violations)
        merged.update(changes)
        return config_from_dict(merged)


def config_to_dict(config: RapidformerConfig) -> dict[str, dict[str, object]]:
    """``{section: {field: value}}`` with plain Python values."""
    return {
        section: {spec.name: getattr(getattr(config, section), spec.name) for spec in specs}
        for section, specs in _by_section().items()
    }


def config_from_dict(values: dict[str, object]) -> RapidformerConfig:
    """Build a config from a nested or flat dict, checking names and types; reports every
    unknown key and badly typed value at once. Aliases (:mod:`rapidformer.config.aliases`)
    set the field they stand for."""
    flat, twice = flatten(values)
    flat, violations = aliases.resolve(flat)
    violations = twice + violations
    per_section: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    table = fields_by_name()
    for key, raw in flat.items():
        spec = table.get(key)
        if spec is None:
            violations.append(_unknown_key(key))
            continue
        try:
            per_section[spec.section][spec.name] = _coerce(spec, raw)
        except ValueError as exc:
            violations.append(Violation(spec.flag, raw, str(exc), _type_fix(spec)))
    if violations:
        raise ConfigError(violations)
    return RapidformerConfig(
        **{section: cls(**per_section[section]) for section, cls in SECTIONS.items()}
    )


def flatten(values: dict[str, object]) -> tuple[dict[str, object], list[Violation]]:
    """``{data: {micro_batch_size: 2}}``, ``{micro-batch-size: 2}`` and ``{--micro_batch_size:
    2}`` alike as ``{micro_batch_size: 2}``: one key per name, however it was spelled or
    nested. A name given twice with different values is refused (whichever spelling came first
    would otherwise win unseen)."""
    flat: dict[str, object] = {}
    spelled: dict[str, str] = {}
    violations: list[Violation] = []
    for outer, value in values.items():
        section = str(outer).lstrip("-")
        pairs: list[tuple[str, object, object]] = [(str(outer), outer, value)]
        if section in SECTIONS and isinstance(value, dict):
            pairs = [(f"{section}.{k}", k, v) for k, v in value.items()]
        for where, key, raw in pairs:
            name = str(key).lstrip("-").replace("-", "_")
            if name in flat and flat[name] != raw:
                violations.append(Violation(
                    "--" + name.replace("_", "-"), raw,
                    f"is given twice with different values ({spelled[name]}: {flat[name]!r}, "
                    f"{where}: {raw!r})",
                    "keep one of them",
                ))  # fmt: skip
                continue
            flat[name], spelled[name] = raw, where
    return flat, violations


def _coerce(spec: FieldSpec, raw: object) -> object:
    if raw is None:
        if spec.optional:
            return None
        raise ValueError("must not be null")
    if spec.kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise ValueError("must be true or false")
    if spec.kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError("must be an integer")
        try:
            value: object = int(raw)  # a str like "8" from a file is fine
        except ValueError:
            raise ValueError("must be an integer") from None
    elif spec.kind is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ValueError("must be a number")
        try:
            value = float(raw)  # YAML reads 1e-4 (no dot) as a string
        except ValueError:
            raise ValueError("must be a number") from None
    else:
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        value = raw
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"must be one of {', '.join(spec.choices)}")
    return value


def _type_fix(spec: FieldSpec) -> str:
    if spec.choices:
        return f"use one of: {', '.join(spec.choices)}"
    return f"give a {spec.kind.__name__} value"


def _unknown_key(key: str) -> Violation:
    names = sorted({spec.name.replace("_", "-") for spec in all_fields()})
    names += [alias.flag[2:] for alias in aliases.ALIASES]
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
    fix = f"did you mean --{close[0]}?" if close else "see docs/parameters.md for every flag"
    return Violation("--" + key.replace("_", "-"), key, "no such flag", fix)


def _by_section() -> dict[str, list[FieldSpec]]:
    grouped: dict[str, list[FieldSpec]] = {section: [] for section in SECTIONS}
    for spec in all_fields():
        grouped[spec.section].append(spec)
    return grouped
