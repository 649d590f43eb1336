"""The black-box entry point: ``rapidformer [flags]`` or ``python -m rapidformer [flags]``.

``--user-script FILE`` runs the Trainer subclass defined in FILE with the same flags;
``--task pretraining`` runs the Pretrainer; the fine-tuning tasks (sequence_classification,
token_classification, question_answering, masked_lm, casual_lm / causal_lm, seq2seq_lm) run
the Finetuner.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rapidformer.config.env import LaunchEnv
from rapidformer.config.loading import parse_args
from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import ConfigError, Preempted, RapidformerError, Violation, exit_code_of

# torch loads only once the flags have parsed: `rapidformer --help` and a bad flag answer in a
# fraction of a second (tests/test_cli.py times it).
if TYPE_CHECKING:
    from rapidformer.templates.trainer import Trainer


def load_trainer_class(script: str) -> type[Trainer]:
    """The one concrete Trainer subclass defined in ``script``."""
    from rapidformer.templates.trainer import Trainer

    path = Path(script)
    if not path.is_file():
        raise ConfigError.single("--user-script", script, "the file must exist", "check the path")
    spec = importlib.util.spec_from_file_location(f"rapidformer_user_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, Trainer)
        and not inspect.isabstract(obj)
        and obj.__module__ == module.__name__
    ]
    if len(found) != 1:
        names = ", ".join(cls.__name__ for cls in found) or "none"
        raise ConfigError.single(
            "--user-script",
            script,
            f"must define exactly one concrete Trainer subclass (found: {names})",
            "define one class that subclasses rapidformer.Trainer and implements its hooks",
        )
    return found[0]


def trainer_class_for(config: RapidformerConfig) -> type[Trainer]:
    script, task = config.training.user_script, config.training.task
    if script is not None:
        return load_trainer_class(script)
    if task is None:
        raise ConfigError.single(
            "--task",
            None,
            "a black-box run needs a task",
            "pass --task TASK, or --user-script FILE with your Trainer",
        )
    if task == "pretraining":
        from rapidformer.templates.pretrainer import Pretrainer  # imports the data stack

        return Pretrainer
    from rapidformer.templates.finetuner import Finetuner  # every other task fine-tunes

    return Finetuner


def checked_trainer_class(config: RapidformerConfig) -> type[Trainer]:
    """The Trainer class to run, after checking the flags: every problem at once."""
    from rapidformer.engine.validation import validate

    violations: list[Violation] = []
    trainer_class: type[Trainer] | None = None
    try:
        trainer_class = trainer_class_for(config)
    except ConfigError as exc:
        violations.extend(exc.violations)
    extra = trainer_class.config_violations(config) if trainer_class is not None else []
    try:
        validate(config, LaunchEnv.read().world_size, builds_optimizer=False, extra=extra)
    except ConfigError as exc:
        violations.extend(exc.violations)
    if violations or trainer_class is None:
        raise ConfigError(violations)
    return trainer_class


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code (see ``rapidformer.errors.EXIT_CODES``)."""
    from rapidformer.logging import log, setup_console_logging

    setup_console_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("RAPIDFORMER_DEBUG", "0") not in ("", "0")
    try:
        config = parse_args(args)
        if config.planning.dry_run:
            return _dry_run(config)
        from rapidformer.distributed import process_group

        trainer = checked_trainer_class(config)(config)
        try:
            metrics = trainer.fit()
        except BaseException as exc:
            if not isinstance(exc, RapidformerError):
                # Raised on this rank only, maybe: leaving must not wait for peers that are
                # inside a step (they see this rank go and fail naming it).
                process_group.mark_broken()
            raise
        finally:
            trainer.engine.close()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 (the command reports all)
        return report(exc, debug, config_script(args))
    if trainer.engine.is_main_process:
        log.info("final metrics: %s", json.dumps(metrics))
    return 0


def _dry_run(config: RapidformerConfig) -> int:
    """Print the dry run's report (rank 0 only under torchrun: every rank computes the same)."""
    from rapidformer.dryrun.command import REPORT_FILE, run_dry_run

    report = run_dry_run(config)
    if LaunchEnv.read().rank == 0:
        print(report.text())
        if config.checkpoint.save is not None:
            print(f"written to {Path(config.checkpoint.save) / REPORT_FILE}")
    return 0


def config_script(args: Sequence[str]) -> str | None:
    """The --user-script of a command line, to point errors at the user's own code."""
    for index, arg in enumerate(args):
        if arg.startswith("--user-script="):
            return arg.split("=", 1)[1]
        if arg == "--user-script" and index + 1 < len(args):
            return args[index + 1]
    return None


def report(exc: BaseException, debug: bool, script: str | None = None) -> int:
    """Print one message for the error that ended the run (the traceback too with
    ``debug``) and return the exit code."""
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, Preempted):
        print(f"rapidformer: {exc}", file=sys.stderr)
    elif isinstance(exc, RapidformerError):
        print(f"rapidformer: error: {exc}", file=sys.stderr)
    elif isinstance(exc, KeyboardInterrupt):
        print("rapidformer: interrupted", file=sys.stderr)
        return 130
    else:
        print(
            f"rapidformer: error: {type(exc).__name__}: {exc} ({_origin(exc, script)})."
            + ("" if debug else " Rerun with --debug (or RAPIDFORMER_DEBUG=1) for the traceback"),
            file=sys.stderr,
        )
    return exit_code_of(exc)


def _origin(exc: BaseException, script: str | None) -> str:
    """Where ``exc`` was raised: the innermost frame in the user's script if it passed
    through it, else the innermost frame."""
    if isinstance(exc, SyntaxError):  # the frame is the importer's: the file is in the error
        return f"in {exc.filename}, line {exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    mine = [f for f in frames if script is not None and Path(f.filename) == Path(script)]
    frame = (mine or frames)[-1]
    return f"raised in {frame.name} at {frame.filename}:{frame.lineno}"
