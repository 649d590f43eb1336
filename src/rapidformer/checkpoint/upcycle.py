"""Reading a dense checkpoint into an MoE model (``--moe-use-upcycling`` with ``--load``);
see :mod:`rapidformer.models.upcycling`."""

from __future__ import annotations

from pathlib import Path

from rapidformer.checkpoint.directory import read_progress
from rapidformer.checkpoint.formats import read_model_state, saved_format
from rapidformer.errors import CheckpointError
from rapidformer.models.upcycling import upcycled_state_dict
from rapidformer.state import TrainState


def load_upcycled(state: TrainState, path: Path) -> None:
    """Read the dense checkpoint at ``path`` (a checkpoint directory) into the MoE model of
    ``state``: experts from the dense FFNs, everything else as saved, routers as initialised.
    Refused (CheckpointError) when the checkpoint is not a dense version of this model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    record = read_progress(path)
    dense = read_model_state(path, saved_format(path, record))
    if any(".ffn.router." in key or ".ffn.experts." in key for key in dense):
        raise CheckpointError(
            f"--moe-use-upcycling: {path} already holds an MoE model; resume it with --load "
            "and without --moe-use-upcycling"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    for part in state.model_parts:
        wanted = set(part.state_dict())
        try:
            weights = upcycled_state_dict(dense, part)
        except KeyError as missing:
            raise CheckpointError(
                f"--moe-use-upcycling: {path} has no dense FFN weight {missing} for this model"
            ) from None
        absent = sorted(k for k in wanted - set(weights) if ".ffn.router." not in k)
        if absent:
            raise CheckpointError(
                f"--moe-use-upcycling: {path} lacks {absent[:3]} (and {max(0, len(absent) - 3)} "
                "more): it is not a dense version of this model"
            )
        set_model_state_dict(
            part, {k: v for k, v in weights.items() if k in wanted}, options=options
        )
