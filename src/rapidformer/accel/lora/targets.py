"""Which layers get adapters, and which modules train in full beside them.

``--lora-target-modules`` is ``all-linear`` (PEFT's meaning: every linear layer but the
model's output head), comma-separated names (a name matches a module path equal to it or
ending in ``.name``, as PEFT matches a list), or a regular expression matched against the whole
path (as PEFT matches a string). Linear layers are ``nn.Linear`` (float8 and NF4 ones
included) and transformers' ``Conv1D`` (GPT-2's, whose weight is stored transposed).

``--lora-modules-to-save`` defaults to the task's freshly initialised head: an adapter alone
cannot learn a classifier that starts random, so PEFT's sequence-classification models save
theirs too.
"""

from __future__ import annotations

import re

from torch import nn

from rapidformer.accel.lora.layer import is_conv1d
from rapidformer.errors import ConfigError
from rapidformer.models.hf import NEW_WEIGHTS

ALL_LINEAR = "all-linear"
OUTPUT_HEADS = ("lm_head", "embed_out", "output", "head", "classifier", "score", "qa_outputs")
"""Last components of module paths that are a model's output head (never adapted by
all-linear)."""
TASK_HEADS: dict[str, tuple[str, ...]] = {
    "sequence_classification": ("classifier", "score"),
    "token_classification": ("classifier", "score"),
    "question_answering": ("qa_outputs",),
}
"""The head each task adds to its pretrained model (the default modules to save)."""
_NAME_LIST = re.compile(r"[\w.,\- ]+")


def is_linear(module: nn.Module) -> bool:
    """A layer an adapter can sit on: ``nn.Linear`` or transformers' ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_paths(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if name and is_linear(module)]


def modules_to_save(model: nn.Module, given: str | None, task: str | None) -> list[str]:
    """The module paths trained in full: the flag's names (each must name a module), else the
    task's head where the model has one and every module whose weights the checkpoint lacked
    (a Hugging Face load says which: a frozen layer of random values could not be reproduced
    from the adapter)."""
    paths = [name for name, _ in model.named_modules() if name]
    if given is None:
        heads = TASK_HEADS.get(task or "", ())
        new = {name.rsplit(".", 1)[0] for name in getattr(model, NEW_WEIGHTS, ())}
        chosen = [p for p in paths if p in heads or p in new]
        return [p for p in chosen if not any(p.startswith(c + ".") for c in chosen)]
    named: list[str] = []
    for name in _split(given):
        found = [p for p in paths if _matches_name(p, name)]
        if not found:
            raise ConfigError.single(
                "--lora-modules-to-save",
                given,
                f"{name!r} names no module of {type(model).__name__}",
                f"name some of its top-level modules: {', '.join(_top_level(model))}",
            )
        named += [p for p in found if not any(p.startswith(c + ".") for c in named)]
    return named


def present_modules(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """The paths of ``names`` that the model has (an adapter's modules to save: PEFT lists
    every head a task may have, ``classifier`` and ``score``)."""
    paths = [name for name, _ in model.named_modules() if name]
    return [p for p in paths if any(_matches_name(p, n) for n in names)]


def target_paths(model: nn.Module, spec: str, saved: list[str]) -> list[str]:
    """The linear layers that get adapters (outside the modules to save)."""
    inside_saved = {
        p for p in linear_paths(model) for s in saved if p == s or p.startswith(s + ".")
    }
    candidates = [p for p in linear_paths(model) if p not in inside_saved]
    if spec == ALL_LINEAR:
        found = [p for p in candidates if not is_output_head(model, p)]
    elif _NAME_LIST.fullmatch(spec):
        names = _split(spec)
        found = [p for p in candidates if any(_matches_name(p, n) for n in names)]
    else:
        try:
            pattern = re.compile(spec)
        except re.error as exc:
            raise ConfigError.single(
                "--lora-target-modules", spec, f"is not a regular expression: {exc}",
                "pass all-linear, comma-separated names or a valid regular expression",
            ) from None  # fmt: skip
        found = [p for p in candidates if pattern.fullmatch(p)]
    if not found:
        raise ConfigError.single(
            "--lora-target-modules",
            spec,
            f"matches no linear layer of {type(model).__name__} (outside the modules to save)",
            f"name some of its linear layers: {', '.join(linear_names(model))}",
        )
    return found


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (``q_proj``, ``fc1`` ...): what
    an error offers as targets."""
    return sorted({p.rsplit(".", 1)[-1] for p in linear_paths(model)})


def is_output_head(model: nn.Module, path: str) -> bool:
    """Whether ``path`` is the model's output head (by name, or as its output embedding)."""
    return path.rsplit(".", 1)[-1] in OUTPUT_HEADS or path in _output_heads(model)


def _output_heads(model: nn.Module) -> set[str]:
    """Paths of the output embedding layer Hugging Face models name (``get_output_embeddings``)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {name for name, module in model.named_modules() if head is not None and module is head}


def _matches_name(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def _split(names: str) -> list[str]:
    return [n.strip() for n in names.split(",") if n.strip()]


def _top_level(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_children()]
