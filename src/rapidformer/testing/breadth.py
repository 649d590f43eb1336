"""The architecture x task matrix of black-box fine-tuning: each Hugging Face family of
:mod:`rapidformer.testing.families` through each task it supports, on the learnable data of
:mod:`rapidformer.testing.finetune`. Shared by the tests (bounds) and by
``benchmarks/hf_architectures.py`` (the table in docs/finetuning.md).

Each cell fine-tunes on one process in fp32, evaluates, saves, then reloads the saved directory
with ``transformers`` and compares its logits with the fine-tuned model's on validation batches.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = (
    "bert",
    "roberta",
    "deberta_v2",
    "modernbert",
    "gpt2",
    "llama",
    "qwen2",
    "mistral",
    "t5",
    "bart",
)
"""The families the matrix covers (the MoE families are covered in tests of their own)."""


@dataclass(frozen=True)
class TaskCase:
    flags: tuple[str, ...]
    metric: str
    chance: float | None
    """What guessing scores (None: the vocabulary size, a uniform guess's perplexity)."""
    bound: float
    """What a model that learned must do better than: a fraction of ``chance`` for perplexity
    (lower is better), an absolute score otherwise."""

    @property
    def lower_is_better(self) -> bool:
        return self.metric == "perplexity"


_LM = ("--train-iters", "120", "--lr", "3e-3")
CASES: dict[str, TaskCase] = {
    # 4 verbs: chance accuracy 0.25.
    "sequence_classification": TaskCase(
        ("--epochs", "5", "--global-batch-size", "32", "--lr", "5e-3"), "accuracy", 0.25, 0.5
    ),
    # Entity-level F1 of a random tagger is ~0. Dynamic shape: batches padded to buckets.
    "token_classification": TaskCase(
        ("--train-iters", "120", "--lr", "3e-3", "--data-iterator", "dynamic-shape"),
        "f1",
        0.0,
        0.6,
    ),
    # One of the three phrases at random: 33 exact match; a random span ~0.
    "question_answering": TaskCase(("--epochs", "6", "--lr", "5e-3"), "exact_match", 33.3, 50.0),
    # Language models: validation perplexity under a quarter of a uniform guess's.
    "masked_lm": TaskCase(_LM, "perplexity", None, 0.25),
    "causal_lm": TaskCase(_LM, "perplexity", None, 0.25),
    "seq2seq_lm": TaskCase(
        ("--train-iters", "60", "--lr", "5e-3", "--data-iterator", "dynamic-shape"),
        "perplexity",
        None,
        0.25,
    ),
}
COMMON = ("--seq-length", "64", "--micro-batch-size", "16", "--log-interval", "1000")


@dataclass
class CellResult:
    architecture: str
    task: str
    model_class: str
    metric: str
    value: float
    chance: float
    bound: float
    """The score to beat (perplexity: below it; others: above it)."""
    token_accuracy: float | None
    reload_max_diff: float
    """Max |logit difference| between the fine-tuned model and its reload by transformers."""
    reload_same_predictions: bool
    seconds: float
    steps: int

    @property
    def learned(self) -> bool:
        if self.metric == "perplexity":
            return self.value < self.bound
        return self.value > self.bound


def run_cell(
    architecture: str, task: str, model: Path, data: Path, save: Path, steps: int | None = None
) -> CellResult:
    """Fine-tune the model in ``model`` for ``task`` on ``data``, save to ``save``, reload.
    ``steps``: that many steps in place of the case's length (a cell that checks the save and
    reload, not the learning)."""
    from rapidformer import Finetuner, parse_args

    case = CASES[task]
    length = (
        list(case.flags)
        if steps is None
        else [*_without_length(case.flags), "--train-iters", str(steps)]
    )
    flags = [
        *("--task", task, "--pretrained-model-name-or-path", str(model), "--data-dir", str(data)),
        *COMMON,
        *length,
        *("--eval-interval", "100000", "--save", str(save)),
    ]
    started = time.perf_counter()
    trainer = Finetuner(parse_args(flags))
    try:
        metrics = trainer.fit()
    finally:
        trainer.engine.close()
    seconds = time.perf_counter() - started
    assert trainer.model is not None
    vocabulary = len(trainer.tokenizer)
    chance = float(vocabulary) if case.chance is None else case.chance
    bound = case.bound * chance if case.lower_is_better else case.bound
    same, gap = reload_gap(trainer, save)
    return CellResult(
        architecture=architecture,
        task=task,
        model_class=type(trainer.model).__name__,
        metric=case.metric,
        value=float(metrics[case.metric]),
        chance=chance,
        bound=bound,
        token_accuracy=metrics.get("token_accuracy"),
        reload_max_diff=gap,
        reload_same_predictions=same,
        seconds=seconds,
        steps=_steps(save),
    )


def _without_length(flags: tuple[str, ...]) -> list[str]:
    """``flags`` less its run length (``--epochs N``, ``--train-iters N``)."""
    kept: list[str] = []
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name not in ("--epochs", "--train-iters"):
            kept += [name, value]
    return kept


def reload_gap(trainer: Any, save: Path, samples: int = 8) -> tuple[bool, float]:
    """Reload the model ``trainer`` saved in ``save`` with transformers' Auto class of its
    task; returns (same argmax predictions, max |logit difference|) on ``samples`` validation
    samples."""
    import torch
    import transformers

    auto = getattr(transformers, trainer.task.auto_class)
    reloaded = auto.from_pretrained(save).eval()
    assert trainer.data is not None and trainer.data.valid is not None
    batch = trainer.task.collate([trainer.data.valid[i] for i in range(samples)])
    inputs = trainer.task.inputs(batch)
    trainer.model.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(**inputs), reloaded(**inputs)
    same, gap = True, 0.0
    for key in ("logits", "start_logits", "end_logits"):
        if key in ours:
            same = same and bool(torch.equal(ours[key].argmax(-1), theirs[key].argmax(-1)))
            gap = max(gap, (ours[key] - theirs[key]).abs().max().item())
    return same, gap


def _steps(save: Path) -> int:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return max((int(record["step"]) for record in map(json.loads, lines)), default=0)
