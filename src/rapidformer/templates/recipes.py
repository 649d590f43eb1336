"""The Finetuner's defaults where the flags are silent: the task's recipe (the Hugging Face
examples' learning rate, epochs and warmup), what a switch changes of it (adapters take a
larger learning rate), and the run's first line that says what was chosen and where from."""

from __future__ import annotations

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature
from rapidformer.engine.order import FEATURES
from rapidformer.templates.tasks import TASKS, canonical_task, task_for


def with_recipe(config: RapidformerConfig, task: str | None) -> RapidformerConfig:
    """``config`` with ``task``'s recipe, and the recipe values of the switches it turns on,
    where the flags leave them open."""
    open_ = _open_choices(config)
    if not open_ or task is None or canonical_task(task) not in TASKS:
        return config
    recipe = task_for(task).recipe.flags()
    for feature in _switched_on(config):
        recipe.update(feature.recipe)
    return config.replace(**{name: recipe[name] for name in open_})


def defaults_line(
    task: str, given: RapidformerConfig, chosen: RapidformerConfig, source: str | None
) -> str:
    """What ``chosen`` holds that ``given`` left open, with where it came from (``source``:
    who chose, None for the recipe), or "" when nothing was filled in."""
    before, after = given.to_dict(), chosen.to_dict()
    filled = [
        f"--{name.replace('_', '-')} {_text(value)}"
        for section, fields in after.items()
        for name, value in fields.items()
        if before[section][name] != value
    ]
    if not filled:
        return ""
    if source is None:
        source = task_for(task).recipe.source
        open_before = set(_open_choices(given))
        for feature in _switched_on(chosen):
            source += "".join(
                f"; --{name.replace('_', '-')} {_text(value)} for {feature.name}"
                for name, value in feature.recipe.items()
                if name in open_before
            )
    return (
        f"fine-tuning defaults for {task} ({source}): {', '.join(filled)}; a flag given "
        "overrides each"
    )


def _text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _switched_on(config: RapidformerConfig) -> list[Feature]:
    return [feature for feature in FEATURES if feature.switched_on(config) is not None]


def _open_choices(config: RapidformerConfig) -> list[str]:
    """The recipe's fields the flags leave open: the learning rate, the length (neither
    --train-iters nor --epochs) and the warmup (neither warmup flag)."""
    training = config.training
    open_ = ["lr"] if training.lr is None else []
    if training.train_iters is None and training.epochs is None:
        open_.append("epochs")
    if training.lr_warmup_fraction is None and not training.lr_warmup_iters:
        open_.append("lr_warmup_fraction")
    return open_
