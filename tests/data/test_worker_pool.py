"""rapidformer.data.worker_pool: results in task order, a bounded read-ahead, a dead worker is
an error (not a hang), and workers do not inherit the locks of the parent's threads."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import closing

import pytest

from rapidformer.data.worker_pool import IN_FLIGHT_PER_WORKER, WorkerLost, ordered_map

pytestmark = pytest.mark.timeout(120)  # a hang is this module's failure: say so in 2 minutes

HELD = threading.Lock()
"""Held by a thread of the parent while the pool starts; a forked worker would find it held."""


def _take_the_lock() -> None:
    if not HELD.acquire(timeout=10):
        raise RuntimeError("the worker inherited a lock held by another thread of its parent")
    HELD.release()


def _nothing() -> None:
    pass


def _slow_first(task: int) -> int:
    time.sleep(0.3 if task == 0 else 0.0)  # the first task finishes last
    return task * task


def _die_on_three(task: int) -> int:
    if task == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return task


def test_results_come_back_in_task_order() -> None:
    assert list(ordered_map(_slow_first, range(7), 2, _nothing)) == [t * t for t in range(7)]


def test_the_tasks_are_read_a_bounded_distance_ahead() -> None:
    read: list[int] = []

    def tasks() -> Iterator[int]:
        for task in range(100):
            read.append(task)
            yield task

    with closing(ordered_map(_slow_first, tasks(), 2, _nothing)) as results:
        assert next(results) == 0
        assert len(read) == 2 * IN_FLIGHT_PER_WORKER  # not the whole input
    assert len(read) < 100


def test_a_worker_that_dies_is_an_error_not_a_hang() -> None:
    with pytest.raises(WorkerLost, match="ended without its result"):
        list(ordered_map(_die_on_three, range(8), 2, _nothing))


def test_workers_do_not_inherit_the_locks_of_the_parents_threads() -> None:
    """What a plain fork gets wrong: another thread of the parent holds a lock at the moment
    the workers start, and a worker that takes it waits forever (here: 10 s, then raises)."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with HELD:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        assert list(ordered_map(_slow_first, range(4), 2, _take_the_lock)) == [0, 1, 4, 9]
    finally:
        release.set()
        holder.join()
