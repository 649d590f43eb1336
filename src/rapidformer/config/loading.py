"""Building a :class:`RapidformerConfig` from flags and YAML/JSON files (from dicts:
:mod:`rapidformer.config.root`).

Precedence, lowest first: field defaults < ``--config FILE`` < flags given on the command line.
The parser uses ``argparse.SUPPRESS`` defaults so that only flags the user actually typed
override the file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rapidformer.config.fields import all_fields
from rapidformer.config.root import RapidformerConfig, config_from_dict, flatten
from rapidformer.config.schema import SECTIONS
from rapidformer.errors import ConfigError


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
    values = flatten(values)
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
