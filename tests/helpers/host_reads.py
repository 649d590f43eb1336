"""Counting rapidformer's host reads of tensors.

Every tensor-to-host conversion that rapidformer's own code makes (``item``, ``tolist``,
``float()``, ``int()``, ``bool()``, ``cpu``, ``numpy``) is counted by patching those tensor
methods, and filed under the ``run_step`` call in progress; on a GPU each such read of a device
tensor waits for the device to finish the queued work."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import rapidformer
from rapidformer.engine import RapidformerEngine

PACKAGE = Path(rapidformer.__file__).parent
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
HOST_ONLY = {"data/samplers.py:_epoch_order"}
"""Reads of tensors that live on the host on any machine (the sampler's CPU permutation at the
start of each epoch): not a device sync."""


class HostReads:
    """Host reads made from rapidformer's code, by the step running when they happen."""

    def __init__(self) -> None:
        self.step = 0
        self.by_step: dict[int, Counter[str]] = {}

    def record(self) -> None:
        frame = sys._getframe(2)  # the caller of the patched method
        path = Path(frame.f_code.co_filename)
        where = (
            f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}" if PACKAGE in path.parents else ""
        )
        if where and where not in HOST_ONLY:
            self.by_step.setdefault(self.step, Counter())[where] += 1

    def of(self, step: int) -> Counter[str]:
        return self.by_step.get(step, Counter())

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_step.values())


@contextlib.contextmanager
def counting_host_reads() -> Iterator[HostReads]:
    """Inside, every host read from rapidformer's code is counted in the yielded record."""
    reads = HostReads()
    originals: dict[str, Any] = {name: getattr(torch.Tensor, name) for name in READS}
    run_step = RapidformerEngine.run_step

    def counting(original: Callable) -> Callable:
        def counted(self: torch.Tensor, *args: Any) -> Any:
            reads.record()
            return original(self, *args)

        return counted

    def numbered(engine: RapidformerEngine, *args: Any) -> Any:
        reads.step += 1  # reads from here to the next step's start belong to this step
        return run_step(engine, *args)

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        RapidformerEngine.run_step = numbered  # type: ignore[method-assign]
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        RapidformerEngine.run_step = run_step  # type: ignore[method-assign]
