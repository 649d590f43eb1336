"""A collective that fails because a peer died or stalls, as an error naming the peer.

gloo reports a dead peer as "Connection reset by peer [127.0.0.1]:PORT" and a stalled one as
"Timed out waiting 600000ms for recv operation"; neither says which rank is gone. After such a
failure every surviving rank writes a key to the job's rendezvous store (hosted by torchrun's
agent, or by rank 0) and waits a short while for the others' keys: the ranks whose key never
comes are the missing ones (a dead rank writes nothing, a stalled one cannot). The run then
ends with :class:`~rapidformer.errors.PeerLostError`, never waiting past the process group's
timeout (``--distributed-timeout-minutes``) plus that short roll call (at most a quarter of
the timeout, and 10 s).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch.distributed as dist

from rapidformer.distributed import process_group
from rapidformer.errors import PeerLostError, RapidformerError
from rapidformer.reliability.signals import StopSignals

ROLL_CALL_SECONDS = 10.0
"""The longest a surviving rank waits for the others to report after a failed collective (a
quarter of the process group's timeout when that is shorter)."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (not a bug in the step's own code)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "gloo" in text or "Connection reset by peer" in text or "Connection closed" in text
    )


def missing_ranks(timeout_s: float) -> list[int] | None:
    """The ranks that did not report within ``timeout_s`` after a failure (None when the
    rendezvous store itself is unreachable)."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(f"rapidformer/alive/{rank}", "1")
        deadline = time.monotonic() + timeout_s
        pending = [r for r in range(world) if r != rank]
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not store.check([f"rapidformer/alive/{r}"])]
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 (the store host, rank 0 without torchrun, is gone)
        return None
    return pending


@contextlib.contextmanager
def naming_lost_peers(timeout_minutes: float) -> Iterator[None]:
    """Turn a collective's failure inside the block into a :class:`PeerLostError`;
    ``timeout_minutes`` is the process group's timeout (it bounds the roll call)."""
    try:
        yield
    except RapidformerError:
        raise
    except Exception as exc:
        if not process_group.is_distributed() or not is_collective_failure(exc):
            raise
        process_group.mark_broken()  # no farewell barrier with a dead peer
        # torchrun's agent sends SIGTERM to the survivors as soon as one worker died: it
        # must not cut the roll call short (the agent waits 30 s before SIGKILL).
        with StopSignals(announce=False):
            missing = missing_ranks(min(ROLL_CALL_SECONDS, max(1.0, timeout_minutes * 15)))
        if missing is None:
            who = "rank 0 (it hosts the rendezvous store) is unreachable"
        elif missing:
            who = "missing: rank " + ", ".join(str(r) for r in missing)
        else:
            who = "every rank is alive: the network failed between them"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PeerLostError(
            f"a collective failed on rank {dist.get_rank()} ({who}); the peer died or stalls "
            f"(see its log). The failure: {first_line[:300]}. The last checkpoint under --save "
            "is intact: rerun to resume, or launch with torchrun --max-restarts N to restart "
            "automatically"
        ) from exc
