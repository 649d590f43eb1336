"""Sequence classification: one label per text or text pair."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rapidformer.templates.tasks.base import (
    Evaluated,
    Features,
    Recipe,
    Task,
    class_names,
    column,
    texts_of,
)

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset


class SequenceClassification(Task):
    """One label per text (or text pair): accuracy and macro F1 from a confusion matrix."""

    name = "sequence_classification"
    auto_class = "AutoModelForSequenceClassification"
    recipe = Recipe(2e-5, 3, 0.1, "transformers' run_glue.py, with BERT's 10% warmup")
    TEXT = ("text", "sentence", "sentence1", "question", "premise")
    PAIR = ("text_pair", "sentence2", "hypothesis")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        text = column(rows, self.TEXT, split, "text")
        label = column(rows, ("label", "labels"), split, "label")
        pair = next((c for c in self.PAIR if c in rows.column_names), None)
        texts = texts_of(rows, text, split)
        encoded = self._encode(texts, texts_of(rows, pair, split) if pair else None)
        labels = self._labels_from(list(rows[label]), split, class_names(rows, label))
        features = [
            {**{k: v[i] for k, v in encoded.items()}, "labels": labels[i]}
            for i in range(len(labels))
        ]
        return Features(features, split)

    def loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.logits.float(), batch["labels"])

    def statistics(
        self, outputs: Any, batch: Mapping[str, torch.Tensor], loss: torch.Tensor
    ) -> dict[str, Any]:
        logits, labels = outputs.logits.float(), batch["labels"]
        k = logits.shape[-1]
        return {"confusion": torch.bincount(labels * k + logits.argmax(-1), minlength=k * k)}

    def metrics(self, evaluated: Evaluated) -> dict[str, float]:
        assert self.labels is not None
        k = len(self.labels)
        # Rows: true label, columns: predicted.
        confusion = evaluated.total("confusion", size=k * k).view(k, k)
        true_positive = confusion.diagonal()
        precision = true_positive / confusion.sum(0).clamp(min=1)
        recall = true_positive / confusion.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        present = (confusion.sum(0) + confusion.sum(1)) > 0  # macro over labels that occur
        return {
            "accuracy": float(true_positive.sum() / confusion.sum().clamp(min=1)),
            "f1": float(f1[present].mean()) if present.any() else 0.0,
        }
