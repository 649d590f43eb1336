"""Adapters on disk in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

What rapidformer writes, ``peft.PeftModel.from_pretrained(base, DIR)`` loads, and what
``get_peft_model(...).save_pretrained(DIR)`` writes, ``--lora-adapter DIR`` reads (tested both
ways). A tensor's name in the file is the model's own parameter name behind PEFT's prefix
(``base_model.model.`` + ``model.layers.0.self_attn.q_proj.lora_A.weight``): the adapted layer
keeps its path in rapidformer (:mod:`rapidformer.accel.lora.layer`), and PEFT drops its adapter
name (``default``) when it saves. The modules trained in full are saved the same way, whole.

Only what rapidformer's layer computes is read: LoRA, DoRA and rsLoRA on linear layers with no
adapter bias, one rank and alpha for all layers. The keys are read through an allowlist
(:func:`refused_option`): those handled, those that change nothing computed, and every other
one only at the value that leaves it off; anything else is refused by name, never ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rapidformer.accel.lora.layer import AdapterShape
from rapidformer.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {
    "sequence_classification": "SEQ_CLS",
    "token_classification": "TOKEN_CLS",
    "question_answering": "QUESTION_ANS",
    "causal_lm": "CAUSAL_LM",
    "casual_lm": "CAUSAL_LM",
    "seq2seq_lm": "SEQ_2_SEQ_LM",
}
"""rapidformer's task -> PEFT's task type (which PeftModel class loads the adapter)."""
HANDLED = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "r", "lora_alpha", "lora_dropout",
    "use_dora", "use_rslora", "target_modules", "modules_to_save", "fan_in_fan_out",
})  # fmt: skip
"""``adapter_config.json`` keys rapidformer reads and computes with."""
DEFINING_KEYS = (
    "r", "lora_alpha", "use_dora", "use_rslora", "target_modules", "modules_to_save",
    "fan_in_fan_out",
)  # fmt: skip
"""The handled keys that decide what the adapters compute: a resume must agree on each."""
NEUTRAL = frozenset({
    "auto_mapping", "peft_version", "revision", "inference_mode", "runtime_config",
    # Each means something only beside an option below, which must then be off.
    "megatron_core", "layers_pattern", "qalora_group_size",
})  # fmt: skip
"""Keys that change nothing the layer computes (provenance, and how PEFT runs it)."""
OFF_ONLY: dict[str, tuple[object, ...]] = {
    "bias": ("none",),
    "lora_bias": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    "layer_replication": (None,),
    "use_qalora": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "exclude_modules": (None, []),
    "alora_invocation_tokens": (None,),
    "use_bdlora": (None, False),
    "monteclora_config": (None,),
    "megatron_config": (None,),
    "ensure_weight_tying": (False, None),
    # PiSSA, OLoRA, CorDA, LoftQ ... initialise from the base and change it: not plain LoRA.
    "init_lora_weights": (True, False, "gaussian"),
    "loftq_config": ({}, None),
    "eva_config": (None,),
    "corda_config": (None,),
    "lora_ga_config": (None,),
    "kasa_config": (None,),
    "arrow_config": (None,),
    "velora_config": (None,),
}
"""PEFT options rapidformer's layer does not implement, with the values that leave them off
(PEFT's defaults)."""
_OFF: tuple[object, ...] = (None, False, {}, [])
"""What a key rapidformer does not know may hold: a later PEFT's option, left at nothing."""


def refused_option(config: Mapping[str, Any]) -> tuple[str, object] | None:
    """The first ``adapter_config.json`` key that asks for something rapidformer's layer does
    not compute, with its value; None when every key is handled, neutral or off. An allowlist:
    a key PEFT adds later is refused unless it holds nothing."""
    for key, value in config.items():
        if key in HANDLED or key in NEUTRAL:
            continue
        off = OFF_ONLY.get(key, _OFF)
        if not any(value == o and type(value) is type(o) for o in off):
            return key, value
    return None


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter directory says besides its tensors."""

    shape: AdapterShape
    targets: tuple[str, ...] | str
    """Module paths (or names, matched as PEFT matches a list), or one regular expression."""
    modules_to_save: tuple[str, ...] = ()
    base: str | None = None
    """Where the base model came from (``base_model_name_or_path``)."""
    task_type: str | None = None
    fan_in_fan_out: bool = False
    """Whether the adapted layers store their weight in x out (GPT-2's ``Conv1D``)."""


def adapter_tensors(
    state: Mapping[str, torch.Tensor], adapted: list[str], saved: list[str]
) -> dict[str, torch.Tensor]:
    """The adapters' and the saved modules' tensors of a whole model state dict, by the
    model's names."""
    keep: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        owner = module.rsplit(".", 1)[0] if leaf == "weight" else module
        own = leaf == "lora_magnitude_vector" or module.endswith((".lora_A", ".lora_B"))
        if (own and owner in adapted) or any(name.startswith(s + ".") for s in saved):
            keep[name] = tensor
    return keep


def peft_config(settings: AdapterSettings) -> dict[str, Any]:
    """``adapter_config.json``'s content for ``settings`` (checkpoints record it too)."""
    shape = settings.shape
    targets = settings.targets
    return {
        "peft_type": "LORA",
        "task_type": settings.task_type,
        "base_model_name_or_path": settings.base,
        "r": shape.rank,
        "lora_alpha": shape.alpha,
        "lora_dropout": shape.dropout,
        "use_dora": shape.variant == "dora",
        "use_rslora": shape.variant == "rslora",
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "modules_to_save": list(settings.modules_to_save) or None,
        "fan_in_fan_out": settings.fan_in_fan_out,
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(
    out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> Path:
    """Write ``tensors`` (model names, as :func:`adapter_tensors` gives them) and ``config``
    (:func:`peft_config`) as a PEFT adapter directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        PREFIX + name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()
    }
    save_file(files, out / WEIGHTS_FILE, metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return out


def read_settings(directory: str | Path, flag: str = "--lora-adapter") -> AdapterSettings:
    """An adapter directory's settings; a missing file, another PEFT method or an option
    rapidformer does not implement is refused, naming it."""
    path = Path(directory)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())) if path.is_dir() else ""
        raise ConfigError.single(
            flag, str(directory),
            f"holds no {CONFIG_FILE}" + (f" (found: {found})" if found else " (no such directory)"),
            "pass a directory written by rapidformer or PEFT's save_pretrained",
        )  # fmt: skip
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError.single(flag, str(directory), f"{config_file} is not JSON: {exc}",
                                 "write the adapter again") from None  # fmt: skip
    return settings_from(config, f"{flag} {directory}")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _value_problems(config: Mapping[str, Any]) -> list[str]:
    """Each value of an adapter's settings that its flag's rules refuse, or that has the wrong
    type, said with its key (and the flag that sets it)."""
    problems = []
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"r={rank!r} (as --lora-rank: a whole number, at least 1)")
    alpha = config.get("lora_alpha", 8)
    if not _number(alpha) or alpha <= 0:
        problems.append(f"lora_alpha={alpha!r} (as --lora-alpha: a finite number above 0)")
    dropout = config.get("lora_dropout", 0.0)
    if not _number(dropout) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout={dropout!r} (as --lora-dropout: at least 0, below 1)")
    targets = config.get("target_modules")
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
    ):
        problems.append(f"target_modules={targets!r} (module names, or one regular expression)")
    saved = config.get("modules_to_save")
    if saved is not None and not (
        isinstance(saved, list) and all(isinstance(m, str) for m in saved)
    ):
        problems.append(f"modules_to_save={saved!r} (a list of module names)")
    problems += [
        f"{key}={config[key]!r} (true or false)"
        for key in ("use_dora", "use_rslora", "fan_in_fan_out")
        if key in config and not isinstance(config[key], bool)
    ]
    return problems


def settings_from(config: Mapping[str, Any], where: str) -> AdapterSettings:
    """Settings from an ``adapter_config.json``'s content; ``where`` names its source in
    errors."""
    flag, _, value = where.partition(" ")
    if not isinstance(config, Mapping):
        raise ConfigError.single(
            flag, value, f"its {CONFIG_FILE} holds a {type(config).__name__}, not the adapter's "
            "settings (a mapping)", "write the adapter again with rapidformer or PEFT",
        )  # fmt: skip
    if config.get("peft_type") != "LORA":
        raise ConfigError.single(
            flag, value,
            f"is a {config.get('peft_type')} adapter; rapidformer trains LoRA (and DoRA, rsLoRA)",
            "pass a LoRA adapter",
        )  # fmt: skip
    refused = refused_option(config)
    if refused is not None:
        option, setting = refused
        known = "" if option in OFF_ONLY else " (an option rapidformer does not know)"
        raise ConfigError.single(
            flag, value,
            f"uses PEFT's {option}={setting!r}{known}, which rapidformer's adapter layer "
            "does not implement",
            "train that adapter with PEFT, or start fresh adapters with --lora-rank",
        )  # fmt: skip
    if config.get("use_dora") and config.get("use_rslora"):
        raise ConfigError.single(
            flag, value,
            "uses DoRA with rsLoRA's scaling together, which rapidformer's layer does not "
            "compute (its variants are one or the other)",
            "train that adapter with PEFT, or start fresh adapters with --lora-rank",
        )  # fmt: skip
    variant = "dora" if config.get("use_dora") else "rslora" if config.get("use_rslora") else "lora"
    targets = config.get("target_modules")
    if targets is None:
        raise ConfigError.single(flag, value, f"{CONFIG_FILE} names no target_modules",
                                 "pass an adapter PEFT saved for a known model")  # fmt: skip
    problems = _value_problems(config)
    if problems:
        raise ConfigError.single(
            flag, value, f"its {CONFIG_FILE} holds {'; '.join(problems)}",
            "write the adapter again (its settings are checked as the flags are)",
        )  # fmt: skip
    shape = AdapterShape(
        int(config["r"]),
        float(config.get("lora_alpha", 8)),
        variant,
        float(config.get("lora_dropout", 0.0)),
    )
    return AdapterSettings(
        shape=shape,
        targets=targets if isinstance(targets, str) else tuple(targets),
        modules_to_save=tuple(config.get("modules_to_save") or ()),
        base=config.get("base_model_name_or_path"),
        task_type=config.get("task_type"),
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
    )


def tensor_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The adapter's tensor shapes by the model's names, read from the file's header: nothing
    is allocated (a shape is checked before a layer of that size is made)."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as weights:
        return {
            key.removeprefix(PREFIX): tuple(weights.get_slice(key).get_shape())
            for key in weights.keys()  # noqa: SIM118 (safe_open is no mapping)
        }


BASE_FILE = "rapidformer-base.json"
"""Beside an adapter rapidformer writes: the fingerprint of the base it was trained on (PEFT
ignores the file; rapidformer refuses the adapter on another base)."""


def write_base(out_dir: str | Path, sha256: str, source: str) -> None:
    if sha256:
        text = json.dumps({"sha256": sha256, "source": source}, indent=2)
        (Path(out_dir) / BASE_FILE).write_text(text + "\n")


def read_base(directory: str | Path) -> dict[str, str] | None:
    """The base an adapter recorded (None: written by PEFT, or before the record existed)."""
    path = Path(directory) / BASE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sha256"), str) else None


def read_tensors(directory: str | Path, flag: str = "--lora-adapter") -> dict[str, torch.Tensor]:
    """The adapter's tensors by the model's names (PEFT's prefix dropped). safetensors only:
    nothing in it can run code."""
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError.single(
            flag, str(directory),
            f"holds no {WEIGHTS_FILE} (a PEFT adapter saved with safe_serialization=False is "
            "read only as safetensors)",
            "save the adapter again with PEFT's default safe_serialization=True",
        )  # fmt: skip
    return {key.removeprefix(PREFIX): value for key, value in load_file(path).items()}
