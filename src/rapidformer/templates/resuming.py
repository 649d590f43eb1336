"""Where a Trainer's run starts: its own last checkpoint, ``--load``, or an upcycled dense
model; and, when a checkpoint does not fit the model, which flags differ from the ones that
wrote it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rapidformer.checkpoint import PROGRESS, find_checkpoint, load_checkpoint
from rapidformer.checkpoint.directory import read_progress
from rapidformer.checkpoint.pretrained import load_pretrained
from rapidformer.checkpoint.upcycle import load_upcycled
from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import CheckpointError
from rapidformer.log import log
from rapidformer.state import TrainState
from rapidformer.templates.progress import Progress, consumed_here


def resume(
    config: RapidformerConfig, state: TrainState, dp: int, main: bool, total_steps: int
) -> Progress:
    """Restore ``state`` from the checkpoint the flags name (``--save`` resumes itself,
    else ``--load``) and return the progress to continue from; a fresh Progress without. A
    checkpoint past the run's ``total_steps`` is refused before anything is read."""
    checkpoints = config.checkpoint
    if checkpoints.pretrained_checkpoint is not None:
        _start_from(checkpoints.pretrained_checkpoint, state, main)
    resumable = find_checkpoint(checkpoints.save) if checkpoints.save else None
    if resumable is not None:
        # The run's own checkpoint wins over --load: rerunning a preempted command that
        # started from --load X continues from its --save, not from X again. (An upcycled
        # run's --load is the dense model it started from.)
        path = resumable
    elif config.moe.moe_use_upcycling:
        return _upcycle_from(config, state, main)
    elif checkpoints.load is not None:
        found = find_checkpoint(checkpoints.load)
        if found is None:
            raise CheckpointError(
                f"--load {checkpoints.load}: no checkpoint there (no 'latest' file and no "
                f"{PROGRESS}). Fix: pass the --save directory of a run, or one of its iter_* "
                "directories"
            )
        path = found
    else:
        return Progress()
    _refuse_other_run(path, config)
    _refuse_past_the_end(path, total_steps)
    try:
        saved = load_checkpoint(path, state)
    except CheckpointError as exc:
        if "Fix:" in str(exc):  # the error knows its cause (a damaged file, another base)
            raise
        raise CheckpointError(f"{exc}{_differences(path, config)}") from exc
    if main:
        log.info("resumed from %s at step %d", path, saved["step"])
    grouped = config.data.data_iterator == "dynamic-shape"
    consumed = consumed_here(saved, config.data.micro_batch_size, dp, grouped)
    # The run's own trackers continue where the checkpoint is its own (--save); a run started
    # from another run's checkpoint (--load) is a run of its own there too.
    own = resumable is not None and isinstance(saved.get("trackers"), dict)
    trackers = {str(k): str(v) for k, v in saved["trackers"].items()} if own else {}
    return Progress(saved["step"], saved["epoch"], consumed, trackers)


def _start_from(source: str, state: TrainState, main: bool) -> None:
    """The whole model's weights at ``source``: where a fresh run starts, and under adapters the
    frozen base every resume needs again (their checkpoints hold no base)."""
    sha256 = load_pretrained(state, source)
    if state.frozen_base is not None:
        # Resolved: an export run from another directory finds the base again.
        where = str(Path(source).resolve())
        state.frozen_base = replace(state.frozen_base, fingerprint=sha256, source=where)
        # The additions' own start, on the base now in place (DoRA's magnitude is its norms).
        for part in state.model_parts:
            state.frozen_base.additions.start(part)
    if main:
        log.info("weights from --pretrained-checkpoint %s", source)


def _upcycle_from(config: RapidformerConfig, state: TrainState, main: bool) -> Progress:
    """A fresh MoE run whose experts start from the dense checkpoint at --load."""
    source = config.checkpoint.load
    path = find_checkpoint(source) if source is not None else None
    if path is None:
        raise CheckpointError(
            f"--moe-use-upcycling needs --load with a dense checkpoint; none at {source}"
        )
    load_upcycled(state, path)
    if main:
        log.info("upcycled the dense checkpoint %s into the MoE model: a fresh run", path)
    return Progress()


SAME_RUN = {
    "model": ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"),
    "moe": ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size"),
    "training": ("seed",),
}
"""The flags a resume must share with the run that wrote the checkpoint: those that shape the
model (a model of other heads loads its tensors without an error, and reads them wrongly) and
the seed (another seed draws other data and other dropout: another run)."""


def _refuse_past_the_end(path: Path, total_steps: int) -> None:
    """A checkpoint of a later step than this run ends at would train nothing and report
    success: its step is a bad input (a length changed since, or an edited record)."""
    step = read_progress(path)["step"]
    if step > total_steps:
        raise CheckpointError(
            f"{path} is at step {step}, past this run's last step {total_steps} "
            "(--train-iters, or --epochs over the data): resuming would train nothing. Fix: "
            "give the length the run was started with, or start afresh with another --save"
        )


def _refuse_other_run(path: Path, config: RapidformerConfig) -> None:
    try:
        saved = json.loads((path / PROGRESS).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return  # unreadable: the load says so, naming the file
    if not isinstance(saved, dict):
        return  # written before checkpoints recorded their flags
    now = config.to_dict()
    changed = [
        f"--{key.replace('_', '-')} {saved[section][key]!r} there, {now[section][key]!r} now"
        for section, keys in SAME_RUN.items()
        for key in keys
        if isinstance(saved.get(section), dict)
        and key in saved[section]
        # Not given on one side: a default filled in later, or the model's own config decides.
        and now[section][key] is not None
        and saved[section][key] is not None
        and saved[section][key] != now[section][key]
    ]
    if changed:
        raise CheckpointError(
            f"{path} was written by another run ({'; '.join(changed)}): resuming it would "
            "read its tensors into another model or continue another run. Fix: resume it "
            "with those flags, or give this run its own --save (and no --load)"
        )


def _differences(path: Path, config: RapidformerConfig) -> str:
    """The model and task flags whose values differ from those the checkpoint was written
    with, as a sentence to append to the error (empty when none differ or none are known)."""
    try:
        saved: dict[str, Any] = json.loads((path / PROGRESS).read_text()).get("config", {})
    except (OSError, ValueError):
        return ""
    now = config.to_dict()
    changed = [
        f"--{key.replace('_', '-')} {value!r} there, {now[section].get(key)!r} now"
        for section in ("model", "training")
        for key, value in saved.get(section, {}).items()
        if key in ("task", *now["model"]) and now[section].get(key) != value
    ]
    if not changed:
        return ". Fix: resume it with the flags that wrote it (its progress.json holds them)"
    return (
        f". It was written with other flags ({'; '.join(changed)}). Fix: resume it with those "
        "flags, or start afresh with another --save"
    )
