"""The causal LM's chat and instruction data: samples rendered with the chat template, labels
on what the model learns (:mod:`rapidformer.data.chat_masks`), and the samples truncation left
with nothing to learn refused or dropped, counted."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.chat import data_format, samples
from rapidformer.data.chat_masks import ChatRenderer
from rapidformer.data.named_templates import template_names, template_path
from rapidformer.data.packing import pack_rows, packing_note
from rapidformer.errors import DataError, Violation
from rapidformer.labels import IGNORE_INDEX
from rapidformer.log import log
from rapidformer.templates.tasks.base import Features

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset


@dataclass(frozen=True)
class ChatOptions:
    """How the causal LM treats chat and instruction data (the flags of the same names)."""

    chat_template: str | None = None
    """A template given by --chat-template (its text), instead of the tokenizer's."""
    chat_template_file: str | None = None
    train_on_inputs: bool = False
    drop_unsupervised: bool = False

    def given(self) -> list[str]:
        """The flags set that only chat and instruction data read."""
        return [
            flag
            for flag, on in (
                ("--chat-template", self.chat_template is not None),
                ("--train-on-inputs", self.train_on_inputs),
                ("--drop-unsupervised", self.drop_unsupervised),
            )
            if on
        ]


CHAT_FLAGS = ("chat_template", "train_on_inputs", "drop_unsupervised", "packing")
"""The causal LM's data flags."""


def chat_violations(config: RapidformerConfig, task: str | None) -> list[Violation]:
    """The chat flags are the causal LM's, and a template file must exist."""
    data = config.data
    given = [name for name in CHAT_FLAGS if getattr(data, name) not in (None, False)]
    violations = [
        Violation(
            f"--{name.replace('_', '-')}",
            getattr(data, name),
            f"applies to the data of --task causal_lm (this run: {task})",
            "drop it",
        )
        for name in given
        if task != "causal_lm"
    ]
    if data.packing and data.data_iterator == "dynamic-shape":
        violations.append(
            Violation(
                "--packing",
                True,
                "cannot run with --data-iterator dynamic-shape: packed rows are all "
                "--seq-length tokens, there is no padding left for buckets to save",
                "drop one of them",
            )
        )
    template = data.chat_template
    if template is not None and template_path(template) is None:
        violations.append(
            Violation(
                "--chat-template",
                template,
                "is no file and no template rapidformer ships",
                f"pass a Jinja chat template file, or one of {', '.join(template_names())}",
            )
        )
    return violations


def packed(features: Features, seq_length: int) -> Features:
    """``--packing``: the split's samples in rows of ``seq_length`` tokens
    (:mod:`rapidformer.data.packing`)."""
    rows = pack_rows(features.rows, seq_length)
    note = packing_note(features.split, len(features), rows, seq_length)
    return Features(rows, features.split, notes=[*features.extra.get("notes", ()), note])


def options_of(config: RapidformerConfig) -> ChatOptions:
    """The chat flags of ``config``, the template file read."""
    data = config.data
    path = template_path(data.chat_template) if data.chat_template is not None else None
    return ChatOptions(
        chat_template=path.read_text() if path is not None else None,
        chat_template_file=data.chat_template,
        train_on_inputs=data.train_on_inputs,
        drop_unsupervised=data.drop_unsupervised,
    )


def is_supervised_data(rows: HFDataset) -> bool:
    return data_format(rows.column_names) != "text"


def refuse_chat_flags_on_text(rows: HFDataset, split: str, options: ChatOptions) -> None:
    """A chat flag on plain text would change nothing: said, not ignored."""
    flags = options.given()
    if flags:
        raise DataError(
            f"{', '.join(flags)} set, and the {split} split is plain text (columns: "
            f"{', '.join(rows.column_names)}): they apply to a messages column or prompt and "
            "completion columns only. Fix: drop them, or give the data in one of those formats"
        )


CACHE_VERSION = 2
"""Bumped when what a cached file holds changes."""


def supervised_features(
    rows: HFDataset, split: str, tokenizer: Any, seq_length: int, options: ChatOptions
) -> Features:
    """The split rendered and labelled, read from the cache beside the dataset's own Arrow
    files when the same data, tokenizer, template, length and flags made it before (JSON: no
    code can run from it). A cached file is checked as strictly as a rendering: its key and
    its checksum, every id in the vocabulary, every label masked or the id it labels, every
    row within --seq-length; one that fails is rendered again, with a warning."""
    found = _cache_file(rows, split, tokenizer, seq_length, options)
    if found is not None and found[0].is_file():
        cache, key = found
        try:
            saved = json.loads(cache.read_text())
            problem = _cache_problem(saved, key, len(tokenizer), seq_length)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"unreadable ({type(exc).__name__})"
        if problem is None:
            # Its name only: the folder is the dataset's own Arrow cache, a path of some 150
            # characters that every split would repeat.
            notes = [*saved["notes"], f"{split}: rendered samples read from the cache {cache.name}"]
            return Features(saved["rows"], split, notes=notes)
        log.warning("the cache %s %s: the %s split is rendered again", cache, problem, split)
    features = _render_split(rows, split, tokenizer, seq_length, options)
    if found is not None:
        cache, key = found
        staged = cache.with_name(f"{cache.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        record = {"key": key, "checksum": _checksum(features.rows), "rows": features.rows,
                  "notes": features.extra["notes"]}  # fmt: skip
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run time
            staged.write_text(json.dumps(record))
            os.replace(staged, cache)  # whole or absent, whichever rank writes it
    return features


def _checksum(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def _cache_problem(
    saved: dict[str, Any], key: dict[str, Any], vocab: int, seq_length: int
) -> str | None:
    """What is wrong with a cached rendering (None: nothing): made for other data or
    settings, edited since, or holding rows no rendering makes."""
    if saved.get("key") != key:
        return "was made for other data or settings"
    if saved.get("checksum") != _checksum(saved["rows"]):
        return "does not match its checksum (edited or damaged)"
    for index, row in enumerate(saved["rows"]):
        ids, labels, mask = row["input_ids"], row["labels"], row["attention_mask"]
        if not 0 < len(ids) <= seq_length or len(labels) != len(ids) or mask != [1] * len(ids):
            return (
                f"holds row {index} of {len(ids)} tokens, not 1 to {seq_length} with a label each"
            )
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            return f"holds an id outside the vocabulary of {vocab} in row {index}"
        if any(
            label not in (IGNORE_INDEX, token) for token, label in zip(ids, labels, strict=True)
        ):
            return f"holds a label in row {index} that is neither masked nor its token"
    return None


def _cache_file(
    rows: HFDataset, split: str, tokenizer: Any, seq_length: int, options: ChatOptions
) -> tuple[Path, dict[str, Any]] | None:
    """Where this split's rendering is cached: beside the dataset's Arrow files, named by a
    hash of everything the rendering depends on (its key, returned too); None for a dataset in
    memory."""
    files = getattr(rows, "cache_files", None)
    fingerprint = getattr(rows, "_fingerprint", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not files or fingerprint is None or backend is None:
        return None
    key = {
        "version": CACHE_VERSION,
        "data": fingerprint,
        "split": split,
        "tokenizer": hashlib.sha256(backend.to_str().encode()).hexdigest(),
        "template": options.chat_template or tokenizer.chat_template,
        "seq_length": seq_length,
        "train_on_inputs": options.train_on_inputs,
        "drop_unsupervised": options.drop_unsupervised,
        "eos": tokenizer.eos_token,
        "bos": tokenizer.bos_token,
        "transformers": _transformers_version(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(files[0]["filename"]).parent / f"rapidformer-chat-{digest}.json", key


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _render_split(
    rows: HFDataset, split: str, tokenizer: Any, seq_length: int, options: ChatOptions
) -> Features:
    renderer = ChatRenderer(
        tokenizer,
        seq_length,
        options.chat_template,
        f"--chat-template {options.chat_template_file}" if options.chat_template_file else "",
        options.train_on_inputs,
    )
    rendered = [renderer.render(s, i, split) for i, s in enumerate(samples(rows, split))]
    # A token's label is scored by the position before it: the first token is never learned.
    empty = [i for i, sample in enumerate(rendered) if not any(sample.supervised[1:])]
    if empty and not options.drop_unsupervised:
        shown = ", ".join(str(i) for i in empty[:5]) + (" ..." if len(empty) > 5 else "")
        raise DataError(
            f"{len(empty)} of the {split} split's {len(rendered)} samples have no token to "
            f"learn from once cut to --seq-length {seq_length} (rows {shown}): they would "
            "train on nothing. Fix: a longer --seq-length, or --drop-unsupervised to leave "
            "them out (counted in the log)"
        )
    dropped = set(empty)
    if rendered and len(dropped) == len(rendered):
        raise DataError(
            f"all {len(rendered)} samples of the {split} split have no token to learn from once "
            f"cut to --seq-length {seq_length}, and --drop-unsupervised dropped every one: "
            "nothing is left to train on. Fix: a longer --seq-length, or check that the data "
            "holds assistant turns (or completions)"
        )
    rows_out = [
        {
            "input_ids": sample.input_ids,
            "attention_mask": [1] * len(sample.input_ids),
            "labels": [
                token if on else IGNORE_INDEX
                for token, on in zip(sample.input_ids, sample.supervised, strict=True)
            ],
        }
        for i, sample in enumerate(rendered)
        if i not in dropped
    ]
    truncated = sum(sample.truncated for sample in rendered)
    learned = sum(sum(sample.supervised[1:]) for i, sample in enumerate(rendered)
                  if i not in dropped)  # fmt: skip
    kind = data_format(rows.column_names)
    what = "the assistant's turns" if kind == "messages" else "the completions"
    notes = [
        f"{split}: {len(rows_out)} {kind} samples, {learned:,} tokens learned "
        f"({'every token: --train-on-inputs' if options.train_on_inputs else what})"
        + (f"; {truncated} cut to --seq-length {seq_length}" if truncated else "")
        + (f"; {len(dropped)} dropped with nothing left to learn" if dropped else "")
    ]
    return Features(rows_out, split, notes=notes)
