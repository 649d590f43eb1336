"""Building a :class:`RapidformerConfig` from flags, YAML/JSON files and dicts.

Precedence, lowest first: field defaults < ``--config FILE`` < flags given on the command line.
The parser uses ``argparse.SUPPRESS`` defaults so that only flags the user actually typed
override the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path

from rapidformer.config.fields import FieldSpec, all_fields, fields_by_name
from rapidformer.config.schema import SECTIONS, RapidformerConfig
from rapidformer.errors import ConfigError, Violation


def build_parser() -> argparse.ArgumentParser:
    """The ``rapidformer`` argument parser, one group per config section."""
    parser = argparse.ArgumentParser(
        prog="rapidformer",
        description="Train transformers fast by flipping switches. Every flag is documented "
        "in docs/parameters.md.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON file of flags (nested by section or flat); flags given on the "
        "command line override it.",
    )
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    for spec in all_fields():
        group = groups[spec.section]
        default_note = "" if spec.default is None else f" (default: {spec.default})"
        if spec.kind is bool:
            group.add_argument(spec.flag, action="store_true", help=spec.help)
        else:
            group.add_argument(
                spec.flag,
                type=spec.kind,
                choices=spec.choices,
                help=spec.help + default_note,
                metavar=None if spec.choices else spec.kind.__name__.upper(),
            )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> RapidformerConfig:
    """Parse command-line flags (and the ``--config`` file they name) into a config."""
    namespace = vars(build_parser().parse_args(argv))
    config_file = namespace.pop("config", None)
    values: dict[str, object] = load_file(config_file) if config_file else {}
    values = _flatten(values, source=str(config_file))
    values.update(namespace)
    return config_from_dict(values)


def load_file(path: str | Path) -> dict[str, object]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError.single("--config", str(path), "the file must exist", "check the path")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            loaded = yaml.safe_load(text) or {}
        else:
            loaded = json.loads(text)
    except Exception as exc:
        raise ConfigError.single(
            "--config", str(path), f"the file must be valid YAML or JSON ({exc})", "fix its syntax"
        ) from exc
    if not isinstance(loaded, dict):
        raise ConfigError.single(
            "--config", str(path), "the file must hold a mapping of flags", "write `flag: value`"
        )
    return loaded


def config_to_dict(config: RapidformerConfig) -> dict[str, dict[str, object]]:
    """``{section: {field: value}}`` with plain Python values."""
    return {
        section: {spec.name: getattr(getattr(config, section), spec.name) for spec in specs}
        for section, specs in _by_section().items()
    }


def config_from_dict(values: dict[str, object]) -> RapidformerConfig:
    """Build a config from a nested or flat dict, checking names and types; reports every
    unknown key and badly typed value at once."""
    flat = _flatten(values, source="config")
    violations: list[Violation] = []
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


def _flatten(values: dict[str, object], source: str) -> dict[str, object]:
    """Accept both ``{data: {micro_batch_size: 2}}`` and ``{micro-batch-size: 2}``."""
    flat: dict[str, object] = {}
    for key, value in values.items():
        key = str(key).lstrip("-")
        if key in SECTIONS and isinstance(value, dict):
            flat.update({str(k).lstrip("-"): v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


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
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
    fix = f"did you mean --{close[0]}?" if close else "see docs/parameters.md for every flag"
    return Violation("--" + key.replace("_", "-"), key, "no such flag", fix)


def _by_section() -> dict[str, list[FieldSpec]]:
    grouped: dict[str, list[FieldSpec]] = {section: [] for section in SECTIONS}
    for spec in all_fields():
        grouped[spec.section].append(spec)
    return grouped
