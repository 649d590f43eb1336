"""Where adapters can run, checked before anything is built: the flags that need them, the
values they take, and the switches they cannot run with (each refusal names its flag)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.errors import Violation

_LORA_FLAGS = (
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_variant",
    "lora_modules_to_save",
    "quantize_base",
)


def lora_on(config: RapidformerConfig) -> bool:
    adapters = config.adapters
    return adapters.lora_rank is not None or adapters.lora_adapter is not None


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    adapters = config.adapters
    if not lora_on(config):
        for name in _LORA_FLAGS:
            value = getattr(adapters, name)
            if value != getattr(type(adapters)(), name):
                flag = "--" + name.replace("_", "-")
                yield Violation(flag, value, "needs adapters: LoRA is off", "add --lora-rank R")
        return
    if adapters.lora_alpha is not None and adapters.lora_alpha <= 0:
        yield Violation("--lora-alpha", adapters.lora_alpha, "must be greater than 0",
                        "pass a positive scale, e.g. 2 x --lora-rank")  # fmt: skip
    if adapters.lora_dropout is not None and not 0.0 <= adapters.lora_dropout < 1.0:
        yield Violation("--lora-dropout", adapters.lora_dropout,
                        "must be at least 0 and below 1", "pass e.g. 0.05")  # fmt: skip
    flag, value = ("--lora-rank", adapters.lora_rank) if adapters.lora_rank else (
        "--lora-adapter", adapters.lora_adapter)  # fmt: skip
    if context.dims.pp > 1:
        yield Violation(
            flag, value,
            f"cannot run with --pipeline-model-parallel-size {context.dims.pp}: adapters are "
            "not wired into pipeline stages yet",
            "drop --pipeline-model-parallel-size; data and tensor parallelism and ZeRO-1/2/3 "
            "run with adapters",
        )  # fmt: skip
    if context.dims.tp > 1 and adapters.quantize_base is not None:
        yield Violation(
            "--quantize-base", adapters.quantize_base,
            f"cannot run with --tensor-model-parallel-size {context.dims.tp}: NF4 weights are "
            "not split over tensor-parallel ranks", "drop one of them",
        )  # fmt: skip
    if adapters.quantize_base is not None and config.precision.precision != "bf16":
        yield Violation(
            "--quantize-base", adapters.quantize_base,
            f"needs --precision bf16 (this run: {config.precision.precision}): the layers it "
            "cannot quantise are stored in bf16", "add --precision bf16",
        )  # fmt: skip
    quantizes_here = adapters.quantize_base is not None and context.on_this_machine
    if quantizes_here and importlib.util.find_spec("torchao") is None:
        yield Violation(
            "--quantize-base", adapters.quantize_base, "needs torchao (its NF4 tensor)",
            "pip install 'torchao>=0.18'",
        )  # fmt: skip
    if config.graph.onnx_runtime_training:
        yield Violation(flag, value, "cannot run with --onnx-runtime-training: the exported "
                        "graph has no adapters", "drop --onnx-runtime-training")  # fmt: skip
    if adapters.lora_adapter is not None and context.on_this_machine:
        path = Path(adapters.lora_adapter)
        if not (path / "adapter_config.json").is_file():
            yield Violation(
                "--lora-adapter", adapters.lora_adapter,
                "holds no adapter_config.json" if path.is_dir() else "no such directory",
                "pass a directory written by rapidformer or PEFT's save_pretrained",
            )  # fmt: skip


LORA_LR = 2e-4
"""The learning rate of adapters where --lr is open (PEFT's and TRL's LoRA examples, the QLoRA
paper's for models up to 13B)."""


def late_weight_rules(config: RapidformerConfig) -> Iterator[Violation]:
    """A base built on the meta device has its values only once ``--pretrained-checkpoint`` is
    read: adapters need that checkpoint, and NF4 would quantise nothing."""
    adapters = config.adapters
    meta = "a model built on the meta device (as the Pretrainer's built-in GPT and BERT are)"
    if adapters.quantize_base is not None:
        yield Violation(
            "--quantize-base", adapters.quantize_base,
            f"{meta} gets its base weights only once materialised and loaded: NF4 would "
            "quantise no values",
            "drop --quantize-base (bf16 LoRA stores the frozen linear weights in bf16)",
        )  # fmt: skip
    if lora_on(config) and config.checkpoint.pretrained_checkpoint is None:
        flag = "--lora-rank" if adapters.lora_rank is not None else "--lora-adapter"
        yield Violation(
            flag, adapters.lora_rank or adapters.lora_adapter,
            f"adapters need a base to adapt, and {meta} would start from a random "
            "initialisation",
            "pass the base as --pretrained-checkpoint (a finished pretraining run's --save "
            "directory)",
        )  # fmt: skip


def not_a_model(path: str) -> tuple[str, str] | None:
    """(rule, fix) when ``path``, given as the model, is an adapter directory (None when it
    is not one): where it belongs, and the base it names."""
    directory = Path(path)
    if not (directory / "adapter_config.json").is_file() or (directory / "config.json").is_file():
        return None
    try:
        written = json.loads((directory / "adapter_config.json").read_text())
        base = written["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        base = None
    return (
        f"holds an adapter, not a model (its base: {base or 'not recorded'})",
        "pass the base as --pretrained-model-name-or-path and this directory as --lora-adapter",
    )


FEATURE = Feature(
    "adapters",
    flags=("--lora-rank", "--lora-adapter", *("--" + f.replace("_", "-") for f in _LORA_FLAGS)),
    rules=rules,
    switched_on=lambda config: (
        (config.adapters.lora_rank or config.adapters.lora_adapter) if lora_on(config) else None
    ),
    refused_on={"deepspeed": "DeepSpeed's engine is not given the adapters' frozen base yet"},
    recipe={"lr": LORA_LR},
    recognizes=not_a_model,
    late_weight_rules=late_weight_rules,
)
