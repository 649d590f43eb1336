"""The catalogue of bad inputs (tests/helpers/bad_inputs.py) beyond the command: through a
user's script that calls ``fit()`` (the same message and exit code, no traceback), and on two
ranks (a configuration error is one message and exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest

from rapidformer import Finetuner, Pretrainer, fatal
from rapidformer.checkpoint import find_checkpoint
from rapidformer.cli import checked_trainer_class, load_trainer_class
from rapidformer.config.loading import parse_args
from rapidformer.errors import ConfigError
from tests.helpers.bad_inputs import (
    CASES,
    VICTIM_TEXT,
    WHITE_BOX,
    Case,
    Inputs,
    argv_of,
    build_inputs,
)
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, LAUNCHER_VARIABLES, run_cli


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return build_inputs(tmp_path_factory.mktemp("bad_inputs"))


FIT_DRIVER = DETERMINISTIC_SCRIPT.with_name("fit_driver.py")
COMMAND_ONLY = {"no-task"}
"""Cases about the command's own choice of template: a script chose its class itself."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(command: list[str], timeout: float = 300) -> tuple[int, str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)
    return done.returncode, done.stderr


def _failures(
    case: Case, code: int, error: str, save: Path, said: tuple[str, ...] | None = None
) -> list[str]:
    """What the run did that the case forbids (empty: one message, the case's exit code, the
    input named (``said``: the case's message), no traceback, no checkpoint)."""
    problems = [f"exit {code}, not {case.code}"] if code != case.code else []
    said = case.message if said is None else said
    problems += [f"{part!r} not said" for part in said if part not in error]
    problems += ["a traceback"] if "Traceback" in error else []
    problems += ["a checkpoint left"] if save.exists() and find_checkpoint(save) else []
    if error.count("rapidformer: error") > 1:
        problems.append("the error said more than once")
    return [f"{case.id}: {p}\n{error[-1500:]}" for p in problems]


def _each(jobs: list[Callable[[], list[str]]]) -> list[str]:
    """Run the jobs two at a time (each is one process, or a launcher and its workers)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return [problem for problems in pool.map(lambda job: job(), jobs) for problem in problems]


def _as_a_script(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """What tests/scripts/fit_driver.py does, in this process: the case's Trainer built and
    fitted with no error handling of its own; what escapes is handed to rapidformer.fatal's
    hook as Python hands it to ``sys.excepthook`` (exit code, stderr). The real process
    boundary is crossed by the test below for one case of each kind."""
    capfd.readouterr()
    args = list(argv)
    script = args[args.index("--user-script") + 1] if "--user-script" in args else None
    task = args[args.index("--task") + 1] if "--task" in args else None
    with mock.patch.dict(os.environ):
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        try:
            if script is not None:
                template = load_trainer_class(script)
            else:
                template = Pretrainer if task == "pretraining" else Finetuner
            template(argv=args).fit()
            code: int | None = 0
        except SystemExit as exit:  # argparse's own, as in a script
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException as escaped:  # noqa: BLE001 (what a script lets escape)
            code = fatal.handle_uncaught(escaped)
            if code is None:  # the script's own error: Python prints its traceback, exits 1
                sys.stderr.write("Traceback (most recent call last): ...\n")
                code = 1
    return code, capfd.readouterr().err


def test_every_bad_input_says_the_same_through_a_scripts_fit(
    inputs: Inputs, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A user's script whose fit() (or the flags, the script's Trainer) fails: the same one
    message and exit code as the command, no traceback (rapidformer.fatal's hook)."""
    cases = [c for c in CASES if c.id not in COMMAND_ONLY and c.entry == "rapidformer"]
    problems = []
    for index, case in enumerate(cases):
        save = tmp_path / f"save{index}"
        code, error = _as_a_script(argv_of(case, inputs, save), capfd)
        problems += _failures(case, code, error, save)
    assert not problems, "\n\n".join(problems)


THROUGH_A_PROCESS = ("no-lr", "malformed-jsonl", "checkpoint-other-seed", "hook-raises")
"""One case of each kind (flags, data, a checkpoint, a user script's own error) through a real
script's process: the hook is installed there, and the exit code is the process's."""


@pytest.mark.distributed
def test_a_real_scripts_process_ends_with_the_commands_message_and_code(
    inputs: Inputs, tmp_path: Path
) -> None:
    def job(index: int, case: Case) -> Callable[[], list[str]]:
        def run() -> list[str]:
            save = tmp_path / f"save{index}"
            argv = argv_of(case, inputs, save)
            code, error = _run([sys.executable, str(FIT_DRIVER), *argv])
            return _failures(case, code, error, save)

        return run

    cases = [case for case in CASES if case.id in THROUGH_A_PROCESS]
    assert len(cases) == len(THROUGH_A_PROCESS)
    problems = _each([job(i, case) for i, case in enumerate(cases)])
    assert not problems, "\n\n".join(problems)


CONFIG_ERROR = "rapidformer: error: invalid rapidformer configuration"


def test_every_configuration_error_is_one_message_and_exit_2_on_two_ranks(
    inputs: Inputs, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``rapidformer --nproc-per-node 2``: the flags are checked once before any worker
    starts (or, found by the workers, said by rank 0 only) and the launcher adds nothing, so
    a configuration error is one message and exit 2 (docs/cli.md: torchrun itself adds its
    own traceback). The launcher runs in this process (what it checks needs no worker; the
    workers it starts write to the same stderr), which spares a Python start per case."""

    def command(argv: list[str]) -> tuple[int, str]:
        return _in_process(argv, capfd)

    config_cases = [
        case
        for case in CASES
        if case.entry == "rapidformer"
        and CONFIG_ERROR in command(argv_of(case, inputs, tmp_path / "probe"))[1]
    ]
    assert len(config_cases) >= 10, [c.id for c in config_cases]
    # What the launcher checks itself is cheap to run on two ranks. What only the workers find
    # (a user script's flags, which the script may extend; what needs the model) takes one
    # code path whatever the rule: a few of those cases start workers.
    in_workers = [c for c in config_cases if not _launcher_refuses(c, inputs, tmp_path)]
    checked = [c for c in config_cases if c not in in_workers] + [
        c for c in in_workers if c.id in CHECKED_BY_WORKERS
    ]
    assert len(checked) >= 10 and {c.id for c in in_workers} >= set(CHECKED_BY_WORKERS)
    problems = []
    for index, case in enumerate(checked):
        save = tmp_path / f"save{index}"
        code, error = command(["--nproc-per-node", "2", *argv_of(case, inputs, save)])
        # On two ranks the fix can differ (a batch size per data-parallel rank): the error
        # must be the configuration error naming the case's input.
        problems += _failures(case, code, error, save, (CONFIG_ERROR, case.message[0]))
    assert not problems, "\n\n".join(problems)


def _in_process(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The command in this process, as from a shell (:func:`run_cli`): its exit code and
    what it wrote to stderr."""
    capfd.readouterr()
    code = run_cli(argv)
    return code, capfd.readouterr().err


def _launcher_refuses(case: Case, inputs: Inputs, tmp_path: Path) -> bool:
    """Whether ``rapidformer --nproc-per-node 2`` refuses the case before starting workers."""
    argv = argv_of(case, inputs, tmp_path / "probe")
    try:
        config = parse_args(argv)
        if config.training.user_script is None:
            checked_trainer_class(config, world_size=2)
    except (ConfigError, SystemExit):
        return True
    return False


CHECKED_BY_WORKERS = (
    "no-length",
    "batch-not-multiple",
    "adapter-alpha-nan",
    "qlora-quantizes-nothing",
)
"""Configuration errors of a run on two ranks that its workers find, rank 0 says: a user
script's flag, a combination, an adapter's file, and what needs the model (QLoRA with no
layer to quantize)."""

FOUND_BY_THE_WORKERS = (
    "save-lock-is-a-link",
    "checkpoint-latest-not-text",
    "checkpoint-latest-foreign",
    "checkpoint-step-past-the-end",
    "line-over-16-mib",
    "chat-no-assistant-turn",
    "chat-nothing-left-after-dropping",
)
"""Cases that are no configuration error (a file, a checkpoint, the data): the workers find
them, and the job still says each once with exit 2 (the first rank says it; a later rank
only what it alone met)."""


@pytest.mark.distributed
def test_what_the_workers_find_is_one_message_and_exit_2_on_two_ranks(
    inputs: Inputs, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cases = [case for case in CASES if case.id in FOUND_BY_THE_WORKERS]
    assert len(cases) == len(FOUND_BY_THE_WORKERS)
    problems = []
    for index, case in enumerate(cases):
        save = tmp_path / f"save{index}"
        code, error = _in_process(["--nproc-per-node", "2", *argv_of(case, inputs, save)], capfd)
        problems += _failures(case, code, error, save)
    assert inputs.victim.read_text() == VICTIM_TEXT
    assert not problems, "\n\n".join(problems)


@pytest.mark.distributed
def test_under_torchrun_a_configuration_error_is_said_by_rank_0_only(tmp_path: Path) -> None:
    """Every rank finds the same configuration error; only rank 0 says it and every rank
    exits 2 (torchrun then prints its own failure report and exits 1, as docs/cli.md says)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    code, error = _run(
        [*torchrun, "--nproc_per_node", "2", "-m", "rapidformer", *WHITE_BOX,
         "--global-batch-size", "3"]
    )  # fmt: skip
    assert code != 0
    assert error.count(CONFIG_ERROR) == 1, error[-3000:]
    assert "--global-batch-size=3" in error
    assert "exitcode  : 2" in error or "exitcode: 2" in error, error[-3000:]
