"""One message for the error that ends a run, wherever the run was started.

The ``rapidformer`` command, a user's script calling ``Trainer.fit()`` and every rank under
torchrun end the same way: one line naming the input and the fix (no traceback unless
``--debug`` or ``RAPIDFORMER_DEBUG=1``) and the exit code of ``rapidformer.errors.EXIT_CODES``.
A configuration or data error is the same on every rank of a machine, so only the machine's
first rank prints it; a message from any rank but 0 names its rank.

The command reports what it catches (:func:`report`). A script has no such frame around its
``fit()``: :func:`report_uncaught` installs a ``sys.excepthook`` (once, in a script, not in an
interactive interpreter or a notebook) that reports an error nobody caught the same way and
exits with its code, where the error ended a rapidformer run (rapidformer raised it, or it
came up through rapidformer's code from a hook); the script's own errors keep Python's
traceback. Code that catches the exception sees it as always. A template (when it is built and
when it fits), the engine and the loading of a user script install it; parsing flags does not,
so a notebook or a tool that only parses keeps its own hook.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rapidformer.errors import (
    ConfigError,
    DataError,
    Preempted,
    RapidformerError,
    exit_code_of,
)

if TYPE_CHECKING:
    from torch.distributed import Store

_PACKAGE = Path(__file__).resolve().parent
_installed: list[bool] = [False]
_debug: list[bool] = [False]


def set_debug(on: bool) -> None:
    """``--debug`` of the run being set up: an uncaught error prints its traceback too. The
    run being set up decides, not an earlier one of the same process (a notebook's or a test
    suite's)."""
    _debug[0] = on


def debugging() -> bool:
    return _debug[0] or os.environ.get("RAPIDFORMER_DEBUG", "0") not in ("", "0")


def report(exc: BaseException, debug: bool) -> int:
    """Print one message for the error that ended the run (the traceback too with
    ``debug``) and return the exit code."""
    if debug:
        traceback.print_exception(exc)
    rank, local_rank = _ranks()
    if isinstance(exc, ConfigError) and local_rank != 0:
        # The ranks of one machine find the same one (the same flags and devices): its first
        # rank says it. Another machine's first rank still does.
        _wait_until_said()
        return exit_code_of(exc)
    if isinstance(exc, DataError) and local_rank != 0 and _wait_until_said() == str(exc):
        return exit_code_of(exc)  # the same file's same fault, said by the first rank
    # A data error only this rank met (its own shard, say) is said by this rank.
    code = _say(exc, rank, debug)
    if isinstance(exc, ConfigError | DataError) and local_rank == 0:
        _tell_said(str(exc))
    return code


def _say(exc: BaseException, rank: int, debug: bool) -> int:
    name = "rapidformer" if rank == 0 else f"rapidformer (rank {rank})"
    if isinstance(exc, Preempted):
        print(f"{name}: {exc}", file=sys.stderr)
    elif isinstance(exc, RapidformerError):
        print(f"{name}: error: {exc}", file=sys.stderr)
    elif isinstance(exc, KeyboardInterrupt):
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    else:
        print(
            f"{name}: error: {type(exc).__name__}: {exc} ({_origin(exc)})."
            + ("" if debug else " Rerun with --debug (or RAPIDFORMER_DEBUG=1) for the traceback"),
            file=sys.stderr,
        )
    return exit_code_of(exc)


SAID_WAIT_S = 30
"""How long a silent rank waits for its machine's first rank to say the error."""


def _said_key() -> tuple[Store, str] | None:
    """(torchrun's agent store, this machine's key in it): where the first rank of a machine
    records that it has said a configuration error; None outside torchrun (checked from the
    environment first: no store, and no torch import, for a run of one process) or where the
    store cannot be reached. The key is the agent's own (its host and process, which all its
    workers share) under the attempt's prefix: a configuration error fails the attempt, so the
    agent's next attempt has another prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "LOCAL_RANK" not in os.environ:
        return None
    try:
        import datetime
        import socket

        from rapidformer.config.env import LaunchEnv
        from rapidformer.distributed.process_group import attempt_store

        store = attempt_store(LaunchEnv.read(), datetime.timedelta(seconds=SAID_WAIT_S))
        agent = f"{socket.gethostname()}/{os.getppid()}"
    except Exception:  # noqa: BLE001 (this runs while reporting another error)
        return None
    if store is None:
        return None
    return store, f"said/{agent}"


def _wait_until_said() -> str | None:
    """What the machine's first rank said (None outside torchrun, or when it said nothing
    within :data:`SAID_WAIT_S`). A silent rank leaves only once that rank spoke: torchrun's
    agent stops every worker when the first one exits, and a silent rank that exited first
    had the speaking one killed mid-sentence (seen: exit 2 and no message)."""
    found = _said_key()
    if found is None:
        return None
    store, key = found
    try:
        store.wait([key])
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 (the first rank died, hangs or met nothing: say it here)
        return None


def _tell_said(message: str) -> None:
    """The first rank of a machine has said ``message`` (see :func:`_wait_until_said`)."""
    found = _said_key()
    if found is None:
        return
    store, key = found
    try:
        store.set(key, message)
    except Exception:  # noqa: BLE001 (nobody may be waiting: the message is out)
        return


def _origin(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame of the user's own code (a script, a hook)
    if it passed through any, else the innermost frame."""
    if isinstance(exc, SyntaxError):  # the frame is the importer's: the file is in the error
        return f"in {exc.filename}, line {exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    frame = ([f for f in frames if _users(f.filename)] or frames)[-1]
    return f"raised in {frame.name} at {frame.filename}:{frame.lineno}"


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: neither rapidformer's nor installed packages'
    or the standard library's."""
    path = Path(filename).resolve()
    paths = sysconfig.get_paths()
    installed = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return not any(root == path or root in path.parents for root in {_PACKAGE, *installed})


def _ranks() -> tuple[int, int]:
    """(rank, local rank) as the launcher set them; (0, 0) outside a launched job, or where
    its variables cannot be read (this runs while reporting another error)."""
    from rapidformer.config.env import LaunchEnv

    try:
        env = LaunchEnv.read()
    except (ValueError, KeyError):
        return 0, 0
    return env.rank, env.local_rank


def report_uncaught() -> None:
    """In a script, report an error nobody catches as the command does (see the module
    docstring); idempotent, and nothing in an interactive session."""
    if _installed[0] or hasattr(sys, "ps1") or sys.flags.interactive:
        return
    _installed[0] = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        code = handle_uncaught(exc)
        if code is None:
            previous(kind, exc, tb)  # the script's own error, not one of a rapidformer run
            return
        # Python would exit 1 after this hook: leave with the command's code instead, once
        # the exit handlers ran (process groups, logs, workers) as a normal exit runs them.
        # (atexit's runner is private but stable since Python 3.0; os._exit does not wait
        # for the script's non-daemon threads, which an error that ended the run leaves.)
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    sys.excepthook = hook


def handle_uncaught(exc: BaseException) -> int | None:
    """What the hook does with an error nobody caught: the script's own error gets None (it
    keeps Python's traceback); one that ended a rapidformer run is reported as the command
    reports it, and its exit code returned."""
    if not isinstance(exc, Exception | KeyboardInterrupt) or not _ends_a_run(exc):
        return None
    return report(exc, debug=debugging())


def _ends_a_run(exc: BaseException) -> bool:
    """Whether ``exc`` ended a rapidformer run: rapidformer raised it, or it came up through
    rapidformer's code (a hook rapidformer called raised it)."""
    if isinstance(exc, RapidformerError):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(_PACKAGE in Path(frame.filename).resolve().parents for frame in frames)
