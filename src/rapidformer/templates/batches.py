"""Small things the templates do with batches and step outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from rapidformer.errors import DataError, HookError
from rapidformer.labels import IGNORE_INDEX

StepOutput = torch.Tensor | Mapping[str, Any]
"""What ``train_step`` / ``eval_step`` return: the loss, or a dict with ``loss`` (and, for
evaluation, the statistics ``compute_metrics`` reads)."""


@dataclass
class DataBundle:
    """What ``build_data`` returns: map-style datasets and the function that batches them."""

    train: Dataset | None
    valid: Dataset | None = None
    test: Dataset | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None

    def loaders(self, micro_batch_size: int) -> tuple[DataLoader, DataLoader | None]:
        """The training loader (shuffled) and the validation one, in micro-batches."""
        if self.train is None:
            raise DataError("build_data() returned no training dataset (DataBundle.train is None)")
        train = DataLoader(
            self.train, batch_size=micro_batch_size, shuffle=True, collate_fn=self.collate_fn
        )
        valid = None
        if self.valid is not None:
            valid = DataLoader(
                self.valid, batch_size=micro_batch_size, shuffle=False, collate_fn=self.collate_fn
            )
        return train, valid


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to_device(value, device) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor | Mapping | list | tuple):
            return batch_size(value)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def batch_tokens(batch: Any) -> torch.Tensor | int:
    """Tokens a batch feeds the model, for throughput (on the batch's device, no host sync):
    the real tokens of its ``attention_mask``, else its labels that are not ignored, else the
    elements of its ``input_ids`` (or Megatron's ``text``, or else its first integer tensor of
    two or more dimensions); 0 for a batch that has none of them."""
    if not isinstance(batch, Mapping):
        return 0
    if isinstance(batch.get("attention_mask"), torch.Tensor):
        return batch["attention_mask"].sum()
    if isinstance(batch.get("labels"), torch.Tensor):
        return (batch["labels"] != IGNORE_INDEX).sum()
    for key in ("input_ids", "text"):
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key].numel()
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and not value.is_floating_point():
            return value.numel()
    return 0


def loss_of(output: StepOutput, hook: str) -> torch.Tensor:
    """The loss in a step's output (a tensor, or a dict's ``loss``)."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif not isinstance(output, Mapping) or "loss" not in output:
        keys = list(output) if isinstance(output, Mapping) else type(output).__name__
        raise HookError(
            f"{hook} returned {keys!r}, not a loss: return the micro-batch's mean loss (a "
            "scalar tensor) or a dict with 'loss'"
        )
    else:
        loss = output["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise HookError(
            f"{hook} returned a loss of shape {shape}: it must be a scalar tensor (the "
            "micro-batch's mean loss); reduce it, e.g. with .mean()"
        )
    return loss


def filler_batch(loader: Any) -> Any:
    """A batch of the validation set's first sample, for forwards a rank only joins."""
    return loader.collate_fn([loader.dataset[0]])
