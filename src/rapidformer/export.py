"""Export a checkpoint to Hugging Face format:
``python -m rapidformer.export CHECKPOINT OUT_DIR [--merge-lora]``.

CHECKPOINT is a ``--save`` directory (its ``latest`` checkpoint is used) or one ``iter_*``
directory. For a pretraining checkpoint OUT_DIR then holds ``config.json``, the weights and the
tokenizer, ready for ``transformers.AutoModelForCausalLM`` (GPT) or
``BertForPreTraining.from_pretrained`` (BERT). For a checkpoint of adapters (``--lora-rank``)
it holds PEFT's adapter directory (``PeftModel.from_pretrained(base, OUT_DIR)``), or with
``--merge-lora`` the base model with the adapters folded into its weights (a plain Hugging Face
model directory, the base read from where the run read it: the Hugging Face directory, or for
the built-in GPT and BERT their ``--pretrained-checkpoint``, exported as above).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rapidformer import safe_load
from rapidformer.accel.lora.saving import export_adapter, merge_into
from rapidformer.checkpoint import PROGRESS, consolidated_model_state, find_checkpoint
from rapidformer.checkpoint.directory import read_progress
from rapidformer.config.root import RapidformerConfig
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.errors import CheckpointError, ConfigError, exit_code_of
from rapidformer.templates.families import family_for


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    trust_checkpoint: bool = False,
    merge_lora: bool = False,
) -> Path:
    """Write the model (and tokenizer) of a pretraining checkpoint with ``save_pretrained``
    (safetensors), or a checkpoint's adapters (see the module docstring). Its files are scanned
    before they are unpickled unless ``trust_checkpoint`` (see :mod:`rapidformer.safe_load`)."""
    with safe_load.trusting(trust_checkpoint):
        return _export(checkpoint, out_dir, merge_lora)


def _export(checkpoint: str | Path, out_dir: str | Path, merge_lora: bool) -> Path:
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise CheckpointError(
            f"{out_dir} is a file: the export writes a Hugging Face directory there (and "
            "would have written nothing). Fix: name a new or existing directory"
        )
    path = find_checkpoint(checkpoint)
    if path is None:
        raise CheckpointError(
            f"{checkpoint}: no checkpoint there (no 'latest' file and no {PROGRESS})"
        )
    record = read_progress(path)
    if "config" not in record:
        raise CheckpointError(
            f"{path / PROGRESS} holds no config: it was not written by a rapidformer Trainer"
        )
    adapters = record.get("frozen_base")
    config = RapidformerConfig.from_dict(record["config"])
    built_in = config.data.tokenizer_type is not None  # the Pretrainer's GPT or BERT
    if adapters is not None and not (merge_lora and built_in):
        return export_adapter(
            adapters, consolidated_model_state(path), out_dir, merge_lora=merge_lora
        )
    if merge_lora and adapters is None:
        raise CheckpointError(f"{path} holds no adapters (it was not trained with --lora-rank)")
    data = config.data
    if data.tokenizer_type is None or data.vocab_file is None:
        raise CheckpointError(
            f"{path}: not a pretraining checkpoint (no --tokenizer-type and "
            "--vocab-file in its config)"
        )
    tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file)
    family = family_for(data.tokenizer_type)
    model = family.build_model(config, tokenizer.vocab_size, device="cpu")
    if adapters is None:
        model.load_state_dict(consolidated_model_state(path))
    else:  # the base from its --pretrained-checkpoint, the adapters folded in
        base = find_checkpoint(adapters["source"])
        if base is None:
            raise CheckpointError(
                f"cannot merge: the base the adapters were trained on ({adapters['source']}, "
                "their --pretrained-checkpoint) holds no checkpoint here; copy it back there, "
                "or export the adapter without --merge-lora"
            )
        model.load_state_dict(consolidated_model_state(base))
        merge_into(model, adapters, consolidated_model_state(path))
    return family.export(model, out_dir, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rapidformer.export", description=__doc__)
    parser.add_argument("checkpoint", help="a --save directory or one iter_* directory in it")
    parser.add_argument("out_dir", help="where to write the Hugging Face model")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle the checkpoint's files without the allowlist scan (a trusted source only)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a checkpoint of adapters: write the base with the adapters folded in (a plain "
        "Hugging Face model) instead of PEFT's adapter directory",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            trust_checkpoint=args.trust_checkpoint,
            merge_lora=args.merge_lora,
        )
    except (CheckpointError, ConfigError) as exc:
        print(f"rapidformer.export: error: {exc}", file=sys.stderr)
        return exit_code_of(exc)
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
