"""Adapters out of a run or a checkpoint: a PEFT adapter directory, or a merged model.

* :func:`save_run_adapter`: the Finetuner's final save with ``--lora-rank`` (every rank calls
  it: a sharded model is gathered first).
* :func:`export_adapter`: ``python -m rapidformer.export CHECKPOINT OUT`` for a checkpoint of
  adapters; with ``merge=True`` (``--merge-lora``) a plain Hugging Face model directory with
  the adapters folded into the base weights (the base read from where the run read it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rapidformer.accel.lora.layer import is_conv1d, merge
from rapidformer.accel.lora.peft_format import (
    adapter_tensors,
    save_adapter,
    settings_from,
    write_base,
)
from rapidformer.accel.lora.start import base_fingerprint
from rapidformer.errors import CheckpointError
from rapidformer.state import FrozenBase, Tensors

AUTO_CLASSES = {
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    None: "AutoModelForMaskedLM",
}
"""PEFT's task type -> the Auto class a merged model is loaded into."""


def trained_tensors(base: FrozenBase, full_state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The adapters' and the saved modules' tensors of a whole model state dict."""
    config = base.adapter_config
    return adapter_tensors(
        full_state, list(config["target_modules"]), list(config["modules_to_save"] or ())
    )


def save_run_adapter(
    base: FrozenBase, full_state: Mapping[str, torch.Tensor], out_dir: str | Path
) -> Path:
    """Write the adapter of a run (``full_state``: its gathered model state, rank 0), with the
    fingerprint of its base."""
    out = save_adapter(out_dir, trained_tensors(base, full_state), base.adapter_config)
    write_base(out, base.fingerprint, base.source)
    return out


def export_adapter(
    record: Mapping[str, Any], trained: Mapping[str, torch.Tensor], out_dir: str | Path,
    *, merge_lora: bool = False,
) -> Path:  # fmt: skip
    """Write a checkpoint's adapters (``trained``: its model state, the trained parameters
    only; ``record``: its ``frozen_base`` record) as a PEFT directory, or merged into the base
    as a Hugging Face model directory."""
    config = record["adapter"]
    if not merge_lora:
        out = save_adapter(out_dir, dict(trained), config)
        write_base(out, str(record.get("sha256", "")), str(record.get("source", "")))
        return out
    settings = settings_from(config, "--merge-lora (the checkpoint's adapter)")
    source = settings.base
    if source is None or not Path(source).is_dir():
        raise CheckpointError(
            f"cannot merge: the base the adapters were trained on ({source}) is not a directory "
            "here; export the adapter without --merge-lora, or copy the base back there"
        )
    import transformers

    auto = getattr(transformers, AUTO_CLASSES.get(settings.task_type, "AutoModel"))
    kwargs: dict[str, Any] = {}
    if record.get("model_config"):  # the run's labels, is_decoder, pad id
        config_class = type(transformers.AutoConfig.from_pretrained(source))
        kwargs = {"config": config_class.from_dict(record["model_config"]),
                  "ignore_mismatched_sizes": True}  # fmt: skip
    model = auto.from_pretrained(source, **kwargs)
    merge_into(model, record, trained)
    model.save_pretrained(out_dir)
    _copy_tokenizer(source, out_dir)
    return Path(out_dir)


def merge_into(
    model: torch.nn.Module, record: Mapping[str, Any], trained: Mapping[str, torch.Tensor]
) -> None:
    """Fold a checkpoint's adapters (``record``: its ``frozen_base``) into ``model``, which
    holds the base they were trained on (checked by its fingerprint)."""
    settings = settings_from(record["adapter"], "--merge-lora (the checkpoint's adapter)")
    if base_fingerprint(model, list(settings.modules_to_save)) != record["sha256"]:
        raise CheckpointError(
            f"cannot merge: the model in {record['source']} is not the base the adapters were "
            "trained on (its fingerprint differs); export the adapter without --merge-lora"
        )
    _fold(model, settings, trained)


@torch.no_grad()
def _fold(model: Any, settings: Any, trained: Mapping[str, torch.Tensor]) -> None:
    """The adapters into their layers' weights, the saved modules' tensors into theirs."""
    modules = dict(model.named_modules())
    state = model.state_dict()
    for path in settings.targets:
        layer = modules[path]
        conv1d = is_conv1d(layer)  # per layer: GPT-2's Conv1D stores its weight transposed
        weight = layer.weight.t() if conv1d else layer.weight
        merged = merge(
            weight,
            trained[f"{path}.lora_A.weight"],
            trained[f"{path}.lora_B.weight"],
            trained.get(f"{path}.lora_magnitude_vector"),
            settings.shape,
        ).to(layer.weight.dtype)
        layer.weight.copy_(merged.t() if conv1d else merged)
    for name, tensor in trained.items():
        if any(name.startswith(m + ".") for m in settings.modules_to_save):
            if state[name].shape != tensor.shape:
                raise CheckpointError(
                    f"cannot merge: the checkpoint's {name} is {tuple(tensor.shape)}, the base "
                    f"model's {tuple(state[name].shape)}"
                )
            state[name].copy_(tensor)


def _copy_tokenizer(source: str, out_dir: str | Path) -> None:
    from transformers import AutoTokenizer

    with contextlib.suppress(OSError, ValueError):  # a base saved without its tokenizer
        AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)


@dataclass(frozen=True)
class AdapterExport:
    """How export writes a checkpoint of adapters (:class:`rapidformer.state.FrozenBaseExport`):
    PEFT's adapter directory, or with ``--merge-lora`` the base with the adapters folded in."""

    merge_flag: str = "--merge-lora"
    merge_help: str = (
        "a checkpoint of adapters: write the base with the adapters folded in (a plain Hugging "
        "Face model) instead of PEFT's adapter directory"
    )

    def write(
        self, record: Mapping[str, Any], trained: Tensors, out_dir: Path, merge: bool
    ) -> Path:
        return export_adapter(record, trained, out_dir, merge_lora=merge)

    def merge_into(self, model: nn.Module, record: Mapping[str, Any], trained: Tensors) -> None:
        merge_into(model, record, trained)


EXPORT = AdapterExport()
