"""Errors rapidformer raises on bad input.

Every configuration problem is reported as a :class:`Violation` that names the flag, the value
it had, the rule it broke and how to fix it. :class:`ConfigError` carries one or more of them so
that a user sees every problem of a command line at once instead of fixing them one run at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken configuration rule."""

    flag: str
    """The command-line spelling of the offending flag, e.g. ``--global-batch-size``."""
    value: object
    """The value the flag had."""
    rule: str
    """What must hold."""
    fix: str
    """What the user can change to satisfy the rule."""

    def __str__(self) -> str:
        return f"{self.flag}={self.value!r}: {self.rule}. Fix: {self.fix}"


class RapidformerError(Exception):
    """Base class of every error rapidformer raises on purpose; ``exit_code`` is what the
    ``rapidformer`` command exits with (2: bad input, unless a subclass says otherwise)."""

    exit_code = 2


class ConfigError(RapidformerError, ValueError):
    """The configuration is invalid; ``violations`` lists every broken rule."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        count = len(self.violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        noun = "problem" if count == 1 else "problems"
        super().__init__(f"invalid rapidformer configuration ({count} {noun}):\n{lines}")

    @classmethod
    def single(cls, flag: str, value: object, rule: str, fix: str) -> ConfigError:
        return cls([Violation(flag, value, rule, fix)])


class DataError(RapidformerError, ValueError):
    """A data file or dataset is missing or malformed; the message names the file."""


class CheckpointError(RapidformerError, RuntimeError):
    """A checkpoint cannot be written or read; the message names the directory."""


class HookError(RapidformerError, TypeError):
    """A template subclass's hooks are missing, or one returned what rapidformer cannot use;
    the message names the hook and what to change."""


class NonFiniteError(RapidformerError, FloatingPointError):
    """Too many consecutive steps had a non-finite loss or gradient: the run stopped before
    applying any of them, so its parameters and last checkpoint are intact."""

    exit_code = 3


class PeerLostError(RapidformerError, RuntimeError):
    """A collective failed because another rank died or stalls; the message names it."""

    exit_code = 4


class Preempted(RapidformerError):
    """A stop signal (SIGTERM, SIGINT, SIGUSR1) ended the run after a checkpoint was written;
    rerunning the same command resumes from it."""

    exit_code = 75  # EX_TEMPFAIL: a temporary failure, the caller is invited to retry


EXIT_CODES = {
    "success": 0,
    "unexpected error (a bug, or an exception raised by user code)": 1,
    "bad input: flags, config file, data, model, checkpoint or user-script hooks": 2,
    "non-finite loss or gradients for --max-skipped-steps consecutive steps, or every step": 3,
    "a peer rank died or stalled past --distributed-timeout-minutes": 4,
    "preempted by a signal: a checkpoint was written, rerun to resume": 75,
    "interrupted by a second Ctrl-C": 130,
}
"""The ``rapidformer`` command's exit codes (documented in docs/reliability.md)."""


def exit_code_of(exc: BaseException) -> int:
    """The command's exit code for an error that ended a run."""
    if isinstance(exc, RapidformerError):
        return int(getattr(exc, "exit_code", 2))
    return 1
