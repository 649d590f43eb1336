"""Saving and resuming the whole training state, atomically.

A checkpoint is a directory ``iter_NNNNNNN`` under ``--save`` holding the model and optimizer
(in the run's format, see below), the LR scheduler and loss-scaler states, the trainer's
progress (step, epoch, position in the epoch), the parallel layout (dp/tp/pp/ep), the plan and
config, one RNG-state file per rank, and a manifest of every file's size and SHA-256
(:mod:`.integrity`). It is written into a temporary directory and renamed into place; the
``latest`` pointer is replaced last (:mod:`.directory`). A crash at any moment therefore leaves
either the previous checkpoint or the new one, never half of one; a write error on any rank
leaves the previous one and raises on every rank; a damaged file is found before resuming, and
the newest complete checkpoint is used instead.

How model and optimizer are written is the run's checkpoint format
(:class:`rapidformer.state.CheckpointFormat`): ``state.checkpoint_format`` when an engine brings
its own (DeepSpeed), else the native one for what the run holds
(:func:`rapidformer.checkpoint.formats.native_format`: consolidated files, or DCP shards whenever
a parameter is a DTensor or the model has several parts). The format's name is recorded, so a
later run reads the checkpoint with the matching reader: native checkpoints load into any native
layout and rank count; an engine's own format only into that engine.
"""

from rapidformer.checkpoint.directory import LATEST, PROGRESS, find_checkpoint, iteration_dir
from rapidformer.checkpoint.load import (
    consolidated_model_state,
    gathered_model_state,
    load_checkpoint,
)
from rapidformer.checkpoint.save import save_checkpoint

__all__ = [
    "LATEST",
    "PROGRESS",
    "consolidated_model_state",
    "find_checkpoint",
    "gathered_model_state",
    "iteration_dir",
    "load_checkpoint",
    "save_checkpoint",
]
