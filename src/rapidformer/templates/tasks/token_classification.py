"""Token classification: one tag per word, scored by entity-level F1."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from rapidformer.errors import DataError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.templates.tasks.base import Evaluated, Features, Recipe, Task, class_names, column

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset


class TokenClassification(Task):
    """One tag per word; the word's first sub-token carries it. Entity-level F1 (an entity
    counts when its type and exact word span match), as seqeval computes it for IOB tags."""

    name = "token_classification"
    auto_class = "AutoModelForTokenClassification"
    recipe = Recipe(5e-5, 3, 0.1, "transformers' run_ner.py, with BERT's 10% warmup")
    sequence_keys: ClassVar[dict[str, int | None]] = {**Task.sequence_keys, "labels": IGNORE_INDEX}

    def prepare(self, rows: HFDataset, split: str) -> Features:
        words = column(rows, ("tokens", "words"), split, "tokens (list of words)")
        tags = column(rows, ("ner_tags", "tags", "labels", "pos_tags"), split, "tags")
        sentences = [list(s) for s in rows[words]]
        tag_rows = list(rows[tags])
        flat = [t for row in tag_rows for t in row]
        row_of = [i for i, row in enumerate(tag_rows) for _ in row]
        names = class_names(rows, tags, nested=True)
        ids = iter(self._labels_from(flat, split, names, row_of))
        encoded = self.tokenizer(
            sentences, is_split_into_words=True, truncation=True, max_length=self.seq_length
        )
        features = []
        for i, sentence in enumerate(sentences):
            row_tags = [next(ids) for _ in tag_rows[i]]
            if len(row_tags) != len(sentence):
                raise DataError(
                    f"the {split} split's row {i} has {len(sentence)} words but "
                    f"{len(row_tags)} tags"
                )
            labels, previous = [], None
            for word in encoded.word_ids(i):
                first = word is not None and word != previous
                labels.append(row_tags[word] if first else IGNORE_INDEX)
                previous = word
            feature = {k: v[i] for k, v in encoded.items() if k in self.sequence_keys}
            features.append({**feature, "labels": labels})
        return Features(features, split)

    def loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits, labels = outputs.logits.float(), batch["labels"]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def weight(self, batch: Mapping[str, torch.Tensor]) -> int | torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()  # the loss is a mean over tagged tokens

    def statistics(
        self, outputs: Any, batch: Mapping[str, torch.Tensor], loss: torch.Tensor
    ) -> dict[str, Any]:
        labels = batch["labels"]
        scored = labels != IGNORE_INDEX
        predicted = outputs.logits.argmax(-1)
        assert self.labels is not None
        counts = torch.zeros(3, dtype=torch.long)  # matched, predicted, gold entities
        for row in range(labels.shape[0]):
            mask = scored[row]
            gold = entities([self.labels[i] for i in labels[row][mask].tolist()])
            guess = entities([self.labels[i] for i in predicted[row][mask].tolist()])
            counts += torch.tensor([len(gold & guess), len(guess), len(gold)])
        return {
            "num_tokens": scored.sum(),
            "correct": ((predicted == labels) & scored).sum(),
            "entities": counts,
        }

    def metrics(self, evaluated: Evaluated) -> dict[str, float]:
        entity_counts = evaluated.total("entities", size=3)
        matched, predicted, gold = entity_counts.tolist()
        correct, tokens = evaluated.total("correct"), evaluated.total("num_tokens")
        precision, recall = matched / max(predicted, 1), matched / max(gold, 1)
        return {
            "precision": precision,
            "recall": recall,
            "f1": 2 * precision * recall / max(precision + recall, 1e-12),
            "accuracy": float(correct / tokens.clamp(min=1)),
        }


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """``(type, first, last)`` word spans of IOB / IOB2 tags: B-X starts an entity, I-X
    continues one of type X (or starts one after O or another type), O ends it; a tag
    without prefix (``PER``) acts as I-PER."""
    found: set[tuple[str, int, int]] = set()
    kind: str | None = None
    start = 0
    for index, tag in enumerate([*tags, "O"]):
        prefix, _, name = tag.partition("-") if "-" in tag else ("I", "", tag)
        begins = tag == "O" or prefix == "B" or name != kind
        if begins and kind is not None:
            found.add((kind, start, index - 1))
            kind = None
        if tag != "O" and (begins or kind is None):
            kind, start = name, index
    return found
