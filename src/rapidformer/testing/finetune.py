"""Small fine-tuning datasets, made offline, for the tiny models of
:mod:`rapidformer.testing.families` (:func:`tiny_model` is re-exported here).

:func:`task_dataset` writes
``train.jsonl`` and ``validation.jsonl`` for each fine-tuning task, built so that a tiny model
can learn them in a few hundred steps (tests check learning, not just running):

* sequence_classification: a sentence's label is its verb (4 verbs: chance 0.25);
* token_classification: tag the subject (SUBJ) and place (PLACE) phrases, the place first or
  last at random;
* question_answering: one sentence; "who / what / where is it?" asks for its subject, object
  or place (a random choice among the three spans: 33% exact match);
* masked_lm / causal_lm: the grammar's sentences;
* seq2seq_lm: sentence -> its place phrase.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rapidformer.testing.corpus import OBJECTS, PLACES, SUBJECTS, VERBS
from rapidformer.testing.families import MODEL_KINDS, tiny_model

__all__ = ["CLASS_VERBS", "MODEL_KINDS", "task_dataset", "task_rows", "tiny_model"]

CLASS_VERBS = VERBS[:4]


def _sentence(rng: random.Random, verb: str | None = None) -> tuple[str, str, str]:
    subject, place = rng.choice(SUBJECTS), rng.choice(PLACES)
    verb = verb or rng.choice(VERBS)
    return f"{subject} {verb} {rng.choice(OBJECTS)} {place}", subject, place


def task_rows(task: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` rows of ``task``'s learnable data (see the module docstring)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(count):
        if task == "sequence_classification":
            verb = rng.choice(CLASS_VERBS)
            text, _, _ = _sentence(rng, verb)
            rows.append({"text": text.capitalize() + ".", "label": verb})
        elif task == "token_classification":
            _, subject, place = _sentence(rng)
            rest = f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}".split()
            spans = [(subject.split(), "SUBJ"), (rest, None), (place.split(), "PLACE")]
            if rng.random() < 0.5:
                spans = [spans[2], spans[0], spans[1]]
            tokens: list[str] = []
            tags: list[str] = []
            for words, kind in spans:
                tokens += words
                tags += ["O"] * len(words) if kind is None else _iob(kind, len(words))
            rows.append({"tokens": tokens, "tags": tags})
        elif task == "question_answering":
            subject, verb, thing, place = (
                rng.choice(SUBJECTS),
                rng.choice(VERBS),
                rng.choice(OBJECTS),
                rng.choice(PLACES),
            )
            context = f"{subject} {verb} {thing} {place}.".capitalize()
            word, answer = rng.choice([("Who", subject), ("What", thing), ("Where", place)])
            start = context.lower().index(f" {answer}" if word != "Who" else answer)
            start += word != "Who"
            rows.append(
                {
                    "question": f"{word} is it?",
                    "context": context,
                    "answers": {
                        "text": [context[start : start + len(answer)]],
                        "answer_start": [start],
                    },
                }
            )
        elif task in ("masked_lm", "causal_lm", "casual_lm"):
            rows.append({"text": _sentence(rng)[0].capitalize() + "."})
        elif task == "seq2seq_lm":
            text, _, place = _sentence(rng)
            rows.append({"source": text.capitalize() + ".", "target": place})
        else:
            raise ValueError(f"unknown task {task!r}")
    return rows


def _iob(kind: str, length: int) -> list[str]:
    return [f"B-{kind}"] + [f"I-{kind}"] * (length - 1)


def task_dataset(
    task: str, out_dir: str | Path, *, train: int = 512, validation: int = 128, seed: int = 0
) -> Path:
    """Write ``train.jsonl`` and ``validation.jsonl`` of ``task`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, count, offset in (("train", train, 0), ("validation", validation, 1)):
        rows = task_rows(task, count, seed=seed * 2 + offset)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
