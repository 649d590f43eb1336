"""Export a checkpoint to Hugging Face format:
``python -m rapidformer.export CHECKPOINT OUT_DIR [MERGE] [--vocab-file F --merge-file F]``.

CHECKPOINT is a ``--save`` directory (its ``latest`` checkpoint is used) or one ``iter_*``
directory. For a pretraining checkpoint OUT_DIR then holds ``config.json``, the weights and the
tokenizer, ready for ``transformers.AutoModelForCausalLM`` (GPT) or
``BertForPreTraining.from_pretrained`` (BERT). For a checkpoint of adapters on a frozen base it
holds the adapters' own directory (PEFT's: ``PeftModel.from_pretrained(base, OUT_DIR)``), or with
their merge flag (MERGE, :data:`rapidformer.engine.order.FROZEN_BASE_EXPORT`) the base model
with the adapters folded into its weights (a plain Hugging Face model directory, the base read
from where the run read it: the Hugging Face directory, or for the built-in GPT and BERT their
``--pretrained-checkpoint``, exported as above).

The tokenizer is read from the files the run named (its config, in ``progress.json``). Where they
have moved since, ``--vocab-file`` and ``--merge-file`` name their new place; the checkpoint is
left as it is (editing its ``progress.json`` would break its manifest).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from rapidformer import safe_load
from rapidformer.checkpoint import PROGRESS, consolidated_model_state, find_checkpoint
from rapidformer.checkpoint.directory import read_progress
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.schema import DataConfig
from rapidformer.data.tokenizers import build_tokenizer, is_bert
from rapidformer.engine.order import FROZEN_BASE_EXPORT as ADDITIONS
from rapidformer.errors import CheckpointError, ConfigError, exit_code_of
from rapidformer.quiet import quiet_third_parties
from rapidformer.templates.families import family_for


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    trust_checkpoint: bool = False,
    merge_adapters: bool = False,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model (and tokenizer) of a pretraining checkpoint with ``save_pretrained``
    (safetensors), or a checkpoint's adapters (see the module docstring). Its files are scanned
    before they are unpickled unless ``trust_checkpoint`` (see :mod:`rapidformer.safe_load`).
    ``merge_adapters``: a checkpoint of adapters merged into its base. ``out_dir`` must be new
    or empty (``overwrite``: or an existing directory that is neither the run's nor the
    base's); an OS error writing it is one CheckpointError naming it.
    ``vocab_file`` and ``merge_file``: the tokenizer's files where they are now, in place of
    those the run named."""
    with safe_load.trusting(trust_checkpoint):
        try:
            return _export(
                checkpoint, out_dir, merge_adapters, TokenizerFiles(vocab_file, merge_file),
                overwrite,
            )  # fmt: skip
        except OSError as error:
            raise CheckpointError(
                f"cannot write the export to {out_dir} ({error.strerror or error}"
                f"{f': {error.filename}' if error.filename else ''}). Fix: name a directory "
                "where this user may write, on a disk with room"
            ) from None


@dataclass(frozen=True)
class TokenizerFiles:
    """The export's own ``--vocab-file`` and ``--merge-file`` (None: the run's)."""

    vocab_file: str | None = None
    merge_file: str | None = None

    def resolve(self, path: Path, data: DataConfig) -> tuple[str, str | None]:
        """The files to read: ours where given, else the run's; refused by name if missing."""
        vocab = self.vocab_file or data.vocab_file
        merges = self.merge_file or data.merge_file
        assert vocab is not None and data.tokenizer_type is not None
        needed = [("--vocab-file", vocab, self.vocab_file)]
        if not is_bert(data.tokenizer_type):
            needed.append(("--merge-file", merges or "", self.merge_file))
        for flag, file, ours in needed:
            if not Path(file).is_file():
                whose = "this export's" if ours else "the run's"
                raise CheckpointError(
                    f"{path} was trained with the tokenizer file {file!r} ({whose} {flag}), "
                    "which is not there. Fix: pass where it is now, as "
                    f"python -m rapidformer.export ... {flag} FILE (the checkpoint is unchanged)"
                )
        return vocab, merges


MODEL_FILES = ("config.json", "adapter_config.json", "*.safetensors", "*.bin", "*.pt")
"""What makes a directory hold a model (or an adapter): an export never writes over one."""


def _refuse_destination(out: Path, run: Path, bases: list[str], overwrite: bool) -> None:
    """The export writes only into a new or empty directory (``overwrite``: or another
    existing one), never into the run's own directory or the base the run read."""
    fix = "name a new or empty directory"
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file: the export writes a directory there. Fix: {fix}")
    where = out.resolve()
    if where == run.resolve() or run.resolve() in where.parents:
        raise CheckpointError(f"{out} is inside the run's own directory {run}. Fix: {fix}")
    for base in bases:
        if Path(base).exists() and where == Path(base).resolve():
            raise CheckpointError(
                f"{out} is the base model's directory, which the run's adapters (and any resume "
                f"of it) are checked against: writing there would lose it. Fix: {fix}"
            )
    existing = next(p for p in (out, *out.parents) if p.exists())
    if existing != out and (not existing.is_dir() or not os.access(existing, os.W_OK)):
        reason = "a file" if not existing.is_dir() else "a directory this user may not write"
        raise CheckpointError(
            f"cannot write the export to {out}: {existing} is {reason}. Fix: name a directory "
            "where this user may write"
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted({p.name for pattern in MODEL_FILES for p in out.glob(pattern)})
        what = f"holds a model ({', '.join(held[:3])})" if held else "is not empty"
        raise CheckpointError(
            f"{out} {what}: the export would write over it. Fix: {fix}, or pass --overwrite"
        )


def _export(
    checkpoint: str | Path, out_dir: str | Path, merge: bool, files: TokenizerFiles,
    overwrite: bool = False,
) -> Path:  # fmt: skip
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
    run = path.parent if (path.parent / "latest").exists() else path
    bases = [str(adapters["source"])] if isinstance(adapters, dict) else []
    bases += [config.model.pretrained_model_name_or_path or ""]
    _refuse_destination(Path(out_dir), run, [b for b in bases if b], overwrite)
    built_in = config.data.tokenizer_type is not None  # the Pretrainer's GPT or BERT
    if adapters is not None and not (merge and built_in):
        return ADDITIONS.write(adapters, consolidated_model_state(path), Path(out_dir), merge)
    if merge and adapters is None:
        raise CheckpointError(
            f"{path} holds no adapters (it was not trained with them): drop {ADDITIONS.merge_flag}"
        )
    data = config.data
    if data.tokenizer_type is None or data.vocab_file is None:
        raise CheckpointError(
            f"{path}: not a pretraining checkpoint (no --tokenizer-type and "
            "--vocab-file in its config)"
        )
    tokenizer = build_tokenizer(data.tokenizer_type, *files.resolve(path, data))
    family = family_for(data.tokenizer_type)
    model = family.build_model(config, tokenizer.vocab_size, device="cpu")
    if adapters is None:
        _load_weights(model, consolidated_model_state(path), path, tokenizer.vocab_size)
    else:  # the base from its --pretrained-checkpoint, the adapters folded in
        base = find_checkpoint(adapters["source"])
        if base is None:
            raise CheckpointError(
                f"cannot merge: the base the adapters were trained on ({adapters['source']}, "
                "their --pretrained-checkpoint) holds no checkpoint here; copy it back there, "
                f"or export the adapter without {ADDITIONS.merge_flag}"
            )
        model.load_state_dict(consolidated_model_state(base))
        ADDITIONS.merge_into(model, adapters, consolidated_model_state(path))
    return family.export(model, out_dir, tokenizer)


def _load_weights(model: nn.Module, weights: dict[str, Any], path: Path, vocab_size: int) -> None:
    """The checkpoint's weights into the model built for the tokenizer found; a vocabulary of
    another size (the wrong file given) is named, not left to a shape error of torch's."""
    ours = model.state_dict()
    for name, tensor in weights.items():
        if name in ours and ours[name].shape != tensor.shape:
            raise CheckpointError(
                f"{path} does not fit the tokenizer given: {name} is {tuple(tensor.shape)} "
                f"there and {tuple(ours[name].shape)} for a vocabulary of {vocab_size} tokens. "
                "Fix: pass the vocabulary the run was trained with (--vocab-file, --merge-file)"
            )
    model.load_state_dict(weights)


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
        ADDITIONS.merge_flag, dest="merge_adapters", action="store_true", help=ADDITIONS.merge_help
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an existing directory that is not empty (never the run's own, nor the "
        "base model's)",
    )
    for flag, what in (("--vocab-file", "vocabulary"), ("--merge-file", "BPE merges")):
        parser.add_argument(
            flag,
            help=f"the {what} file where it is now, when it has moved since the run "
            "(default: the file the run named)",
        )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show what transformers, the hub and DeepSpeed print (progress bars, notices)",
    )
    args = parser.parse_args(argv)
    quiet_third_parties(args.verbose)  # as quiet as a run: its output is the last line
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            trust_checkpoint=args.trust_checkpoint,
            merge_adapters=args.merge_adapters,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            overwrite=args.overwrite,
        )
    except (CheckpointError, ConfigError) as exc:
        print(f"rapidformer.export: error: {exc}", file=sys.stderr)
        return exit_code_of(exc)
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
