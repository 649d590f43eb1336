"""How a step's micro-batches become calls of a pipeline schedule: the inputs each stage
takes, the runs of equal shapes (a schedule's stages size their buffers once), and the
micro-batches joined into the one batch ``schedule.step`` cuts again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rapidformer.errors import HookError


def stage_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``model_inputs(batch)`` as the stages take it: (positional, keyword). torch's schedule
    gives the positional inputs to the first stage only (the later ones take the previous
    stage's outputs in their place) and the keyword inputs to every stage, so a mapping's
    ``input_ids`` becomes the first stage's positional input and the rest reaches every stage:
    every key must be one a later stage takes by name (the built-in GPT's ``position_ids``
    and ``document_mask``; BERT's later stages take their mask positionally, so its inputs
    stay a tuple)."""
    if not isinstance(inputs, Mapping):
        return tuple(inputs), {}
    rest = dict(inputs)
    first = rest.pop("input_ids", None)
    return ((first,) if first is not None else ()), rest


def schedulable(run: list[int], schedule: str, pp: int) -> list[list[int]]:
    """``run`` cut where a schedule cannot take it whole: Interleaved1F1B runs rounds of
    ``m // pp`` micro-batches and needs ``m`` to be a multiple of the round count."""
    m = len(run)
    if schedule == "Interleaved1F1B" and m > pp and m % max(1, m // pp):
        whole = pp * (m // pp)
        return [run[:whole], run[whole:]]
    return [run]


def concatenated(values: list[Any]) -> Any:
    """Equal-shaped micro-batch tensors joined along dim 0 (see ``_run_schedule``); a value
    that is not a batched tensor must be the same in every micro-batch, as the schedule hands
    it unchanged to each."""
    if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
        return torch.cat(values)
    if any(value is not values[0] for value in values[1:]):
        raise HookError(
            "under pipeline parallelism every model input must be a tensor with the batch in "
            f"dim 0, or the same object in every micro-batch; got {type(values[0]).__name__} "
            "values that differ: return them from model_inputs(batch) as batched tensors"
        )
    return values[0]


def equal_shapes(args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]) -> list[list[int]]:
    """The step's micro-batches in runs of consecutive equal input shapes. A schedule's stages
    size their buffers once, so micro-batches of different lengths (the dynamic-shape
    iterator) run as several schedule calls whose gradients add up; every pipeline rank
    reads the same batches and cuts the same runs."""
    runs: list[list[int]] = []
    previous = None
    for index, (a, k) in enumerate(zip(args, kwargs, strict=True)):
        key = shapes(a) + shapes(k)
        if key != previous:
            runs.append([])
            previous = key
        runs[-1].append(index)
    return runs


def shapes(values: Any) -> tuple[Any, ...]:
    items = values.values() if isinstance(values, Mapping) else values
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in items)
