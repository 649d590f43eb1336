"""Map a function over a stream of tasks in worker processes, for the preprocessing tool.

* Results come back in the order of the tasks, whatever order the workers finish in.
* At most ``IN_FLIGHT_PER_WORKER`` tasks per worker are handed out ahead of the reader: a
  corpus larger than memory streams through.
* A worker that dies (the kernel's out-of-memory killer, a signal) ends the map with
  :class:`WorkerLost` instead of a wait for a result that never comes.
* Workers start with forkserver where the platform has it, else spawn; never with a plain
  fork. A fork copies a process mid-flight, with the locks its other threads hold at that
  moment (torch's, a tracker's, a test suite's, a library's), and a child that needs one of
  them waits forever: ``--workers 2`` once hung for ten minutes inside a test process that had
  such threads. A fresh worker costs about 0.2 s on two cores, because the preprocessing
  modules import without torch.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from rapidformer.errors import RapidformerError

Task = TypeVar("Task")
Result = TypeVar("Result")

IN_FLIGHT_PER_WORKER = 2
"""Tasks handed out per worker ahead of the reader: one to work on and one queued, so a worker
never waits for the parent between tasks."""


class WorkerLost(RapidformerError, RuntimeError):
    """A worker process ended without returning its task's result."""


def start_method() -> str:
    """forkserver where the platform has it (Linux, macOS), else spawn (Windows)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def ordered_map(
    function: Callable[[Task], Result],
    tasks: Iterable[Task],
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...] = (),
) -> Iterator[Result]:
    """``function(task)`` for each task, computed by ``workers`` processes that each ran
    ``initializer(*initargs)`` first; yields the results in the order of ``tasks``. Close the
    iterator (``contextlib.closing``) when stopping early: that cancels the queued tasks and
    waits for the workers to exit."""
    context = multiprocessing.get_context(start_method())
    pool = ProcessPoolExecutor(workers, context, initializer, initargs)
    pending: deque[Future[Result]] = deque()
    try:
        for task in tasks:
            pending.append(pool.submit(function, task))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future[Result]) -> Result:
    try:
        return future.result()
    except BrokenProcessPool as exc:
        raise WorkerLost(
            f"a worker process ended without its result ({exc}); it was killed (out of "
            "memory?) or crashed. Fix: run again with fewer workers, or look for the kernel's "
            "out-of-memory message (dmesg)"
        ) from None
