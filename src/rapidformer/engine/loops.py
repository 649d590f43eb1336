"""Helpers for hand-written loops around :meth:`RapidformerEngine.run_step`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def steps_of(micro_batches: Iterable[T], accumulation_steps: int) -> Iterator[list[T]]:
    """Group an iterable of micro-batches (a DataLoader) into optimizer steps of
    ``accumulation_steps`` each; the last group of a pass may be shorter (``run_step``
    weights it by what it holds)."""
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, not {accumulation_steps}")
    group: list[Any] = []
    for batch in micro_batches:
        group.append(batch)
        if len(group) == accumulation_steps:
            yield group
            group = []
    if group:
        yield group
