"""``--pretrained-checkpoint``: a fresh run starts from a whole model's weights.

Megatron's ``--finetune`` and Megatron-Bridge's ``pretrained_checkpoint``: the weights of a
finished run's checkpoint, in whatever layout this run has (every rank reads the whole state
and keeps its share), with a fresh optimizer, schedule and data position. Under adapters
they are the frozen base: a checkpoint of adapters holds no base, so the base is read again on
every resume, and its fingerprint (over the checkpoint's values, so the same for any layout or
storage dtype) is what the adapters' checkpoints are checked against.
"""

from __future__ import annotations

import torch

from rapidformer.checkpoint.directory import PROGRESS, find_checkpoint, read_progress
from rapidformer.checkpoint.formats import read_model_state, saved_format
from rapidformer.errors import CheckpointError
from rapidformer.models.fingerprint import weights_fingerprint
from rapidformer.state import TrainState


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def load_pretrained(state: TrainState, source: str) -> str:
    """Read the whole model at ``source`` into ``state``'s model (adapters aside); returns the
    SHA-256 of its frozen weights (for a run with adapters) or "". Refused, with the file
    named, when it is no whole model of this shape."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = find_checkpoint(source)
    if path is None:
        raise CheckpointError(
            f"--pretrained-checkpoint {source}: no checkpoint there (no 'latest' file and no "
            f"{PROGRESS}). Fix: pass the --save directory of a finished run, or one of its "
            "iter_* directories"
        )
    record = read_progress(path)
    if record.get("frozen_base") is not None:
        raise CheckpointError(
            f"--pretrained-checkpoint {path} holds adapters, not a whole model. Fix: resume it "
            "with --load, or export it merged into its base first (python -m rapidformer.export "
            "--help)"
        )
    weights = read_model_state(path, saved_format(path, record))
    if state.mesh.dims.pp == 1:  # a pipeline rank holds only its stages' keys
        held = {k for part in state.model_parts for k in part.state_dict()}
        extra = sorted(k for k in weights if k not in held)
        if extra:
            raise CheckpointError(
                f"--pretrained-checkpoint {path} is not a model of this shape: it has "
                f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which this model "
                f"lacks. Fix: pass the model flags it was trained with (its {PROGRESS} holds them)"
            )
    base = state.frozen_base
    added = base.additions.owns if base is not None else (lambda name: False)
    options = StateDictOptions(full_state_dict=True, strict=False)
    for part in state.model_parts:
        # Whole shapes (a DTensor reports its global one): no value is gathered.
        own = {k: tuple(v.shape) for k, v in part.state_dict().items()}
        wanted = [k for k in own if not added(k)]
        missing = [k for k in wanted if k not in weights]
        wrong = [
            f"{k} is {tuple(weights[k].shape)} there, {own[k]} here"
            for k in wanted
            if k in weights and tuple(weights[k].shape) != own[k]
        ]
        if missing or wrong:
            problems = [f"it has no {k}" for k in missing[:3]] + wrong[:3]
            raise CheckpointError(
                f"--pretrained-checkpoint {path} is not a model of this shape: "
                f"{'; '.join(problems)}. Fix: pass the model flags it was trained with (its "
                f"{PROGRESS} holds them)"
            )
        broken = next((k for k in wanted if not _finite(weights[k])), None)
        if broken is not None:
            raise CheckpointError(
                f"--pretrained-checkpoint {path} holds a NaN or an infinity in {broken}: a run "
                "from it would learn nothing (every step non-finite). Fix: start from a "
                "checkpoint with finite weights"
            )
        try:
            set_model_state_dict(part, {k: weights[k] for k in wanted}, options=options)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"--pretrained-checkpoint {path}: {exc}") from exc
    if base is None:
        return ""
    return weights_fingerprint(
        (name, weights[name])
        for part in state.model_parts
        for name, _ in part.named_parameters()
        if name not in base.trainable and not added(name)
    )
