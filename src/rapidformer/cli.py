"""The black-box entry point: ``rapidformer [flags]`` or ``python -m rapidformer [flags]``.

``--nproc-per-node N`` runs the command on N local processes (:mod:`rapidformer.workers`).
``--task pretraining`` runs the Pretrainer; the fine-tuning tasks (sequence_classification,
token_classification, question_answering, masked_lm, casual_lm / causal_lm, seq2seq_lm) run
the Finetuner.

``--user-script FILE`` runs FILE once, as the program itself: it becomes the process's
``__main__`` with the other flags as its command line, as ``python FILE flags`` would run it,
so the ``if __name__ == "__main__":`` block that PAI-Rapidformer's scripts (and rapidformer's
examples) end with is the run. A script that trains nothing there (no such block: it only
defines a Trainer subclass) gets its one Trainer subclass run with the flags. Either way there
is one run: a script that built an engine while it ran is not followed by a second run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rapidformer.config.env import LaunchEnv
from rapidformer.config.loading import parse_args
from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import ConfigError, RapidformerError, Violation
from rapidformer.fatal import report, report_uncaught
from rapidformer.quiet import quiet_third_parties
from rapidformer.workers import run_local_workers, split_launch

# torch loads only once the flags have parsed: `rapidformer --help` and a bad flag answer in a
# fraction of a second (tests/test_cli.py times it).
if TYPE_CHECKING:
    from rapidformer.templates.trainer import Trainer


def load_trainer_class(script: str) -> type[Trainer]:
    """The one concrete Trainer subclass defined in ``script``, imported as a module (its
    ``__main__`` block does not run)."""
    report_uncaught()  # in a script, a bad script is one message, as the command's
    path = Path(script)
    if not path.is_file():
        raise ConfigError.single("--user-script", script, "the file must exist", "check the path")
    spec = importlib.util.spec_from_file_location(f"rapidformer_user_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return _one_trainer_class(module, script)


@contextlib.contextmanager
def as_the_program(script: str, args: Sequence[str]) -> Iterator[type[Trainer] | None]:
    """Run ``script`` as the program's ``__main__`` with ``args`` as its command line (less
    ``--user-script``); inside, the script's one Trainer subclass for the command to run, or
    None where the script trained itself (it built a RapidformerEngine while it ran).

    Until the context ends the script is the program, as under ``python FILE``: its classes
    pickle by reference to ``__main__`` (data-loader workers), its folder is importable, the
    command line is its own. Then the process's own are back (an in-process caller)."""
    from rapidformer.engine.engine import engines_built

    path = Path(script)
    if not path.is_file():
        raise ConfigError.single("--user-script", script, "the file must exist", "check the path")
    spec = importlib.util.spec_from_file_location("__main__", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # As python FILE leaves it: a spawned process (a data-loader worker under spawn or
    # forkserver) then runs FILE again as __mp_main__ to find its classes; with a spec
    # named __main__ it would skip that and fail to unpickle them.
    module.__spec__ = None
    saved = sys.modules["__main__"], sys.argv, list(sys.path)
    sys.modules["__main__"] = module
    sys.argv = [str(path), *_without_user_script(args)]
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        before = engines_built()
        spec.loader.exec_module(module)
        trained = engines_built() > before
        yield None if trained else _one_trainer_class(module, script, trained=False)
    finally:
        sys.modules["__main__"], sys.argv, sys.path[:] = saved


def _without_user_script(args: Sequence[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--user-script":
            skip = True
        elif not arg.startswith("--user-script="):
            kept.append(arg)
    return kept


def _one_trainer_class(module: object, script: str, trained: bool = True) -> type[Trainer]:
    from rapidformer.templates.trainer import Trainer

    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, Trainer)
        and not inspect.isabstract(obj)
        and obj.__module__ == getattr(module, "__name__", None)
    ]
    if len(found) != 1:
        names = ", ".join(cls.__name__ for cls in found) or "none"
        ran = "" if trained else " and trained nothing when run as the program"
        raise ConfigError.single(
            "--user-script",
            script,
            f"must define exactly one concrete Trainer subclass (found: {names}){ran}",
            "define one class that subclasses rapidformer.Trainer and implements its hooks "
            '(or train in the script\'s `if __name__ == "__main__":` block)',
        )
    return found[0]


def trainer_class_for(config: RapidformerConfig) -> type[Trainer]:
    """The template class a black-box run (no ``--user-script``) runs."""
    task = config.training.task
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


def checked_trainer_class(
    config: RapidformerConfig,
    trainer_class: type[Trainer] | None = None,
    world_size: int | None = None,
) -> type[Trainer]:
    """The Trainer class to run (``trainer_class``, a user script's, or the task's template),
    after checking the flags for ``world_size`` ranks (default: this launch's): every problem
    at once."""
    from rapidformer.engine.validation import validate

    violations: list[Violation] = []
    if trainer_class is None:
        try:
            trainer_class = trainer_class_for(config)
        except ConfigError as exc:
            violations.extend(exc.violations)
    if trainer_class is not None:
        config = trainer_class.config_defaults(config)
    extra = trainer_class.config_violations(config) if trainer_class is not None else []
    try:
        world = LaunchEnv.read().world_size if world_size is None else world_size
        validate(config, world, builds_optimizer=False, extra=extra)
    except ConfigError as exc:
        violations.extend(exc.violations)
    if violations or trainer_class is None:
        raise ConfigError(violations)
    return trainer_class


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code (see ``rapidformer.errors.EXIT_CODES``)."""
    from rapidformer.log import setup_console_logging

    setup_console_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("RAPIDFORMER_DEBUG", "0") not in ("", "0")
    try:
        nproc, args = split_launch(args)
        config = parse_args(args)  # loads no third party: quiet can still be chosen
        quiet_third_parties(config.logging.verbose)
        if config.planning.dry_run:
            return _dry_run(config, nproc)
        if nproc is not None:
            return _launch(config, nproc, args)
        script = config.training.user_script
        if script is None:
            _train(checked_trainer_class(config)(config))
            return 0
        with as_the_program(script, args) as script_class:
            if script_class is not None:  # else the script trained itself, as the program
                _train(checked_trainer_class(config, script_class)(config))
    except SystemExit as ended:  # the script's own sys.exit(): its code, as python FILE
        return _exit_code(ended)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 (the command reports all)
        return report(exc, debug)
    return 0


def _exit_code(ended: SystemExit) -> int:
    """What ``python FILE`` exits with after ``sys.exit(code)``: None is 0, a number itself,
    anything else is printed and is 1."""
    if ended.code is None or isinstance(ended.code, int):
        return ended.code or 0
    print(ended.code, file=sys.stderr)
    return 1


def _launch(config: RapidformerConfig, nproc: int, args: Sequence[str]) -> int:
    """``--nproc-per-node N``: the flags checked for N ranks here, then N workers
    (:mod:`rapidformer.workers`). A user script's run is checked by the workers: the script
    may set flags of its own there (only its file is checked here)."""
    script = config.training.user_script
    if script is None:
        checked_trainer_class(config, world_size=nproc)
    elif not Path(script).is_file():
        raise ConfigError.single("--user-script", script, "the file must exist", "check the path")
    return run_local_workers(nproc, args, saves=config.checkpoint.save is not None)


def _train(trainer: Trainer) -> None:
    from rapidformer.distributed import process_group

    try:
        trainer.fit()
    except BaseException as exc:
        if not isinstance(exc, RapidformerError):
            # Raised on this rank only, maybe: leaving must not wait for peers that are inside
            # a step (they see this rank go and fail naming it).
            process_group.mark_broken()
        raise
    finally:
        trainer.engine.close()


def _dry_run(config: RapidformerConfig, nproc: int | None = None) -> int:
    """Print the dry run's report (rank 0 only under torchrun: every rank computes the same);
    ``--nproc-per-node N`` plans N ranks where ``--dry-run-world-size`` does not say."""
    from rapidformer.dryrun.command import REPORT_FILE, run_dry_run

    if nproc is not None and config.planning.dry_run_world_size is None:
        config = config.replace(dry_run_world_size=nproc)

    report = run_dry_run(config)
    if LaunchEnv.read().rank == 0:
        print(report.text())
        if config.checkpoint.save is not None:
            print(f"written to {Path(config.checkpoint.save) / REPORT_FILE}")
    return 0
