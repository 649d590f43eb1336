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
import sys
from collections.abc import Sequence
from pathlib import Path

from rapidformer.config.env import LaunchEnv
from rapidformer.config.loading import parse_args
from rapidformer.config.root import RapidformerConfig
from rapidformer.engine.validation import validate
from rapidformer.errors import ConfigError, RapidformerError, Violation
from rapidformer.logging import log, setup_console_logging
from rapidformer.templates.trainer import Trainer


def load_trainer_class(script: str) -> type[Trainer]:
    """The one concrete Trainer subclass defined in ``script``."""
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
    setup_console_logging()
    try:
        config = parse_args(argv)
        trainer = checked_trainer_class(config)(config)
        try:
            metrics = trainer.fit()
        finally:
            trainer.engine.close()
    except RapidformerError as exc:
        print(f"rapidformer: error: {exc}", file=sys.stderr)
        return 2
    if trainer.engine.is_main_process:
        log.info("final metrics: %s", json.dumps(metrics))
    return 0
