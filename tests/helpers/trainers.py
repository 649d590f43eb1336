"""The tiny Trainer runs most tests start from, and reading what a run wrote."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from rapidformer import parse_args
from rapidformer.cli import load_trainer_class, main
from rapidformer.templates.trainer import Trainer
from rapidformer.testing import run_distributed
from rapidformer.workers import split_launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_tiny_transformer.py"
DETERMINISTIC_SCRIPT = ROOT / "tests" / "scripts" / "deterministic_trainer.py"

TINY_FLAGS = [
    "--lr",
    "3e-3",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "24",
    "--max-position-embeddings",
    "32",
    "--log-interval",
    "1",
    "--clip-grad",
    "1.0",
]


LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
)  # fmt: skip
"""What a launcher sets in its workers' environment (an in-process DeepSpeed run leaves
LOCAL_RANK behind, as DeepSpeed needs it)."""


def shell_env(**extra: str) -> dict[str, str]:
    """This process's environment as a shell would give a new command: no launcher's
    variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**env, **extra}


@contextmanager
def _as_from_a_shell(**env: str) -> Iterator[None]:
    """This process's environment as a shell gives a command (no launcher's variables, one
    thread per rank, ``env`` added), restored afterwards."""
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", **env}):
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        yield


def run_cli(argv: list[str], **env: str) -> int:
    """``rapidformer ARGV`` in this process, as from a shell (no launcher's variables; one
    thread per rank; ``env`` added): its exit code. With ``--nproc-per-node N`` the launcher
    still spawns N worker processes, so a multi-rank run costs no third interpreter."""
    with _as_from_a_shell(**env):
        try:
            return main(argv)
        except SystemExit as exit:  # argparse's own errors
            return exit.code if isinstance(exit.code, int) else 1


def launched(argv: list[str], capfd: Any = None) -> str:
    """``rapidformer --nproc-per-node N ARGV`` as its workers run it: ``rapidformer.cli.main``
    on N ranks forked from the test process's fork server (:func:`run_distributed`, one
    thread each), asserted to exit 0 on every rank. Returns what they wrote to stderr
    (``capfd``: pytest's fd-level capture; without it "", and the output stays the test's).
    For tests whose point is a multi-rank run's numbers: two fresh interpreters and torchrun's
    agent would add some 5 s to each. The agent's own work (flags checked once, exit codes,
    signals) is tested through the real command in tests/test_workers.py and
    tests/test_bad_inputs_elsewhere.py."""
    nproc, rest = split_launch(argv)
    assert nproc is not None, "launched() runs a --nproc-per-node command"
    if capfd is not None:
        capfd.readouterr()
    with _as_from_a_shell():
        try:
            run_distributed(_rank_of_the_command, nproc, rest)
        except Exception as failed:  # noqa: BLE001 (a rank's failure, with what ranks said)
            said = "" if capfd is None else capfd.readouterr().err
            raise AssertionError(f"{failed}\nthe ranks said:\n{said[-3000:]}") from None
    return "" if capfd is None else str(capfd.readouterr().err)


def _rank_of_the_command(argv: list[str]) -> None:
    code = main(argv)
    assert code == 0, f"rank {os.environ['RANK']}: rapidformer exited {code}"


def tiny_trainer(*flags: str, dropout: float = 0.0, **options: Any) -> Trainer:
    """The example's DemoTrainer on 64 training samples, configured by ``flags``;
    ``options``: the Trainer's own keyword arguments (``callbacks``, ``report_to``)."""
    cls = load_trainer_class(str(DETERMINISTIC_SCRIPT))
    trainer_class = type("Tiny", (cls,), {"dropout": dropout})
    return trainer_class(parse_args([*TINY_FLAGS, *flags]), **options)


def read_losses(save_dir: Path, kind: str = "train") -> dict[int, float]:
    """Step -> loss from a run's metrics.jsonl (JSON floats round-trip exactly)."""
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    key = "loss" if kind == "train" else "eval_loss"
    return {r["step"]: r[key] for r in records if r["kind"] == kind}
