"""Building a :class:`RapidformerConfig` from flags and YAML/JSON files (from dicts:
:mod:`rapidformer.config.root`).

Precedence, lowest first: field defaults < ``--config FILE`` < flags given on the command line.
The parser uses ``argparse.SUPPRESS`` defaults so that only flags the user actually typed
override the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rapidformer.config.aliases import ALIASES, resolve
from rapidformer.config.fields import all_fields
from rapidformer.config.root import RapidformerConfig, config_from_dict, flatten
from rapidformer.config.schema import SECTIONS
from rapidformer.errors import ConfigError, Violation

OTHER_TOOLS_NAMES = {
    "--learning-rate": "--lr",
    "--max-steps": "--train-iters",
    "--num-train-epochs": "--epochs",
    "--per-device-train-batch-size": "--micro-batch-size",
    "--train-batch-size": "--global-batch-size",
    "--gradient-accumulation-steps": "--global-batch-size",
    "--fp16": "--precision fp16",
    "--bf16": "--precision bf16",
    "--output-dir": "--save",
    "--resume-from-checkpoint": "--load",
    "--model-name-or-path": "--pretrained-model-name-or-path",
    "--warmup-steps": "--lr-warmup-iters",
    "--warmup-ratio": "--lr-warmup-fraction",
    "--logging-steps": "--log-interval",
    "--save-steps": "--save-interval",
    "--max-grad-norm": "--clip-grad",
    "--max-seq-length": "--seq-length",
    "--gradient-checkpointing": "--checkpoint-activations",
}
"""Hugging Face / DeepSpeed spellings users bring, and ours."""


class _Parser(argparse.ArgumentParser):
    """argparse, with one line per error instead of the whole usage, and the closest flag
    for a misspelt one."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        unknown = re.findall(r"(--[\w-]+)", message) if "unrecognized" in message else []
        flags = [o for action in self._actions for o in action.option_strings]
        for flag in unknown:
            known = OTHER_TOOLS_NAMES.get(flag.replace("_", "-"))
            close = [known] if known else difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
            if close:
                hint += f" Did you mean {close[0]} (for {flag})?"
        sys.stderr.write(
            f"rapidformer: error: {message}.{hint} Every flag: rapidformer --help and "
            "docs/parameters.md\n"
        )
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``rapidformer`` argument parser, one group per config section."""
    parser = _Parser(
        prog="rapidformer",
        description="Train transformers fast by flipping switches. Every flag is documented "
        "in docs/parameters.md.",
        epilog="Launch: `rapidformer --nproc-per-node N [flags]` runs the command on N local "
        "processes (docs/cli.md).",
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
    section_of = {spec.name: spec.section for spec in all_fields()}
    for alias in ALIASES:  # in the section of the field each sets
        groups[section_of[alias.target]].add_argument(
            alias.flag,
            action="store_true",
            help=f"The same as {alias.meaning} ({alias.origin}'s spelling).",
        )
    return parser


CODE_FLAGS = ("trust_checkpoint", "trust_remote_code", "user_script")
"""Consent to running code (from what a run loads, or a script to run): only the command line
or a Python call may give it, never a config file, under any spelling or nesting."""


def parse_args(argv: Sequence[str] | None = None) -> RapidformerConfig:
    """Parse command-line flags (and the ``--config`` file they name) into a config."""
    return parse_args_with_extras(argv)[0]


ArgsProvider = Callable[[argparse.ArgumentParser], Any]
"""Adds a script's own flags to the parser (Megatron's ``extra_args_provider``)."""


def parse_args_with_extras(
    argv: Sequence[str] | None = None, extra_args_provider: ArgsProvider | None = None
) -> tuple[RapidformerConfig, dict[str, Any]]:
    """Like :func:`parse_args`, with the flags ``extra_args_provider(parser)`` adds returned
    apart (by destination; None when not given and without a default)."""
    parser = build_parser()
    before = set(map(id, parser._actions))
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    extra_dests = [a.dest for a in parser._actions if id(a) not in before and a.dest != "help"]
    namespace = vars(parser.parse_args(argv))
    extras = {dest: namespace.pop(dest, None) for dest in extra_dests}
    config_file = namespace.pop("config", None)
    # Aliases resolve per source, so that a flag on the command line overrides the file
    # whichever spelling each used.
    from_file = read_config_file(config_file) if config_file else {}
    flat, violations = flatten(from_file)
    violations += [
        Violation(
            f"--{name.replace('_', '-')}",
            value if name == "user_script" else True,
            f"cannot come from --config {config_file}: config files are shared and copied, "
            "and this flag lets the run execute code",
            "drop it from the file and pass it on the command line (or in the Python call)",
        )
        for name in CODE_FLAGS
        for value in [next((v for v in _every_value(from_file, name) if _set(v)), None)]
        if value is not None
    ]
    resolved, alias_violations = resolve(flat)
    violations += alias_violations
    typed, typed_violations = resolve(namespace)
    if violations or typed_violations:
        raise ConfigError(violations + typed_violations)
    return config_from_dict({**resolved, **typed}), extras


def _every_value(values: dict[str, object], name: str) -> list[object]:
    """Every value a file gives ``name``, at its top level or in a section, in any
    spelling."""
    found = []
    for key, value in values.items():
        if isinstance(value, dict):
            found += [v for k, v in value.items() if _spelled(k) == name]
        elif _spelled(key) == name:
            found.append(value)
    return found


def _spelled(key: object) -> str:
    return str(key).lstrip("-").replace("-", "_")


def _set(value: object) -> bool:
    """Whether a file's ``value`` asks for anything: every value but an explicit false or
    nothing (a file may say ``false`` harmlessly)."""
    return str(value).strip().lower() not in ("false", "0", "no", "off", "none", "null", "")


def read_config_file(path: str | Path) -> dict[str, object]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError.single("--config", str(path), "the file must exist", "check the path")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError.single(
            "--config", str(path), f"the file is not UTF-8 text ({exc.reason} at byte "
            f"{exc.start})", "give a YAML or JSON file of flags",
        ) from None  # fmt: skip
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
