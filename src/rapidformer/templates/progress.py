"""Where a run stands in its data, and the micro-batches of each optimizer step.

:class:`Progress` is saved in every checkpoint; :func:`step_batches` keeps it exact while it
yields each step's micro-batches, so that a checkpoint taken after any step resumes at the next
sample; :func:`consumed_here` converts a saved position to another data-parallel or
micro-batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rapidformer.data.samplers import ResumableDistributedSampler
from rapidformer.errors import CheckpointError, DataError
from rapidformer.state import TrainState


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0
    """Micro-batches this rank has read in the current epoch."""
    trackers: dict[str, str] = field(default_factory=dict)
    """Each tracker's id of this run (MLflow, W&B, Trackio): a resume continues those runs."""


def consumed_here(saved: dict[str, Any], micro: int, dp: int, grouped: bool = False) -> int:
    """The micro-batches each rank of a run with ``dp`` ranks of micro-batch ``micro`` has
    consumed in the saved epoch. Together the ranks have read a prefix of the epoch's order
    (whole chunks of micro-batch x dp samples), so resuming on another data-parallel size or
    micro-batch size starts after the same samples if the count divides evenly. (Checkpoints
    written before micro-batches became contiguous, when ranks took every dp-th sample, also
    mark a prefix: they resume after the same samples, grouped the new way from there on.)
    A ``grouped`` (dynamic-shape) order is cut into micro-batches of the saved size: mid-epoch,
    it resumes on another dp size but not with another micro-batch size."""
    saved_micro = saved.get("config", {}).get("data", {}).get("micro_batch_size", micro)
    saved_dp = saved.get("parallel", {}).get("dp", saved.get("dp", dp))
    samples = saved["consumed"] * saved_micro * saved_dp
    if grouped and samples and saved_micro != micro:
        raise CheckpointError(
            f"--data-iterator dynamic-shape: the checkpoint stopped mid-epoch with "
            f"--micro-batch-size {saved_micro}, and the length-grouped order of an epoch "
            f"depends on the micro-batch size, so {micro} would read some samples twice and "
            f"skip others; resume with --micro-batch-size {saved_micro} (the rank count may "
            "change)"
        )
    if samples % (micro * dp):
        raise CheckpointError(
            f"the checkpoint's {samples} samples consumed in its epoch do not split into "
            f"micro-batches of {micro} on {dp} data-parallel ranks; resume with a "
            "--micro-batch-size and rank count whose product divides it"
        )
    return samples // (micro * dp)


def step_batches(
    state: TrainState, progress: Progress, total_steps: int, accumulation: int, by_epoch: bool
) -> Iterator[list[Any]]:
    """Yield the micro-batches of each optimizer step (``accumulation`` of them; with
    ``by_epoch``, a shorter last step per epoch), keeping ``progress`` exact so that a
    checkpoint taken after any step resumes at the next sample."""
    loader = state.train_dataloader
    assert loader is not None and isinstance(loader.sampler, ResumableDistributedSampler)
    if loader.sampler.num_samples < state.mesh.dims.dp:
        raise DataError(
            f"the training set ({loader.sampler.num_samples} samples) gives "
            f"each of the {state.mesh.dims.dp} data-parallel ranks nothing"
        )
    group: list[Any] = []
    while progress.step < total_steps:
        loader.sampler.set_position(progress.epoch, progress.consumed * (loader.batch_size or 1))
        for batch in loader:
            progress.consumed += 1
            group.append(batch)
            if len(group) == accumulation:
                yield group
                group = []
                if progress.step >= total_steps:
                    return
        if by_epoch and group:  # the last, shorter step of an epoch
            yield group
            group = []
        progress.epoch += 1
        progress.consumed = 0
