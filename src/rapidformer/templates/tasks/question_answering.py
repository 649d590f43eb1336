"""Extractive question answering (SQuAD format), scored per example."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from rapidformer.distributed.process_group import all_reduce_sum
from rapidformer.errors import DataError
from rapidformer.templates.tasks.base import Evaluated, Features, Recipe, Task, column

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset
    from transformers import PreTrainedTokenizerBase


class QuestionAnswering(Task):
    """Extractive QA (SQuAD format). Contexts longer than the window are split into windows
    that overlap by ``doc_stride`` tokens; a window whose context does not hold the answer
    points at the first token. Scored per example by exact match and token F1, SQuAD's way."""

    name = "question_answering"
    auto_class = "AutoModelForQuestionAnswering"
    recipe = Recipe(3e-5, 2, 0.1, "transformers' run_qa.py (SQuAD), with BERT's 10% warmup")
    sequence_keys: ClassVar[dict[str, int | None]] = {
        **Task.sequence_keys,
        "offset_start": -1,
        "offset_end": -1,
    }
    """``offset_*``: each token's character span in the context (-1 outside the context)."""
    max_answer_tokens = 30

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        seq_length: int,
        seed: int = 0,
        doc_stride: int | None = None,
    ) -> None:
        super().__init__(tokenizer, seq_length, seed)
        self.doc_stride = doc_stride if doc_stride is not None else max(seq_length // 4, 1)
        """Tokens shared by consecutive windows of one context."""

    def prepare(self, rows: HFDataset, split: str) -> Features:
        q = column(rows, ("question",), split, "question")
        c = column(rows, ("context",), split, "context")
        a = column(rows, ("answers",), split, "answers ({'text': [...], 'answer_start': [...]})")
        questions = [s.lstrip() for s in rows[q]]
        contexts, answers = list(rows[c]), list(rows[a])
        encoded = self.tokenizer(
            questions,
            contexts,
            truncation="only_second",
            max_length=self.seq_length,
            stride=self.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
        features = []
        for i in range(len(encoded["input_ids"])):
            example = encoded["overflow_to_sample_mapping"][i]
            sequence = encoded.sequence_ids(i)
            offsets = [
                list(o) if sequence[t] == 1 else [-1, -1]
                for t, o in enumerate(encoded["offset_mapping"][i])
            ]
            start, end = self._span(offsets, answers[example], split, example)
            feature = {k: v[i] for k, v in encoded.items() if k in Task.sequence_keys}
            features.append(
                {
                    **feature,
                    "offset_start": [o[0] for o in offsets],
                    "offset_end": [o[1] for o in offsets],
                    "start_positions": start,
                    "end_positions": end,
                    "feature_index": i,
                    "example_index": example,
                }
            )
        gold = [list(answer["text"]) for answer in answers]
        return Features(features, split, contexts=contexts, answers=gold)

    @staticmethod
    def _span(
        offsets: list[list[int]], answer: Mapping[str, Any], split: str, row: int
    ) -> tuple[int, int]:
        """Token positions of the first answer inside this window, or (0, 0)."""
        try:
            text, first = answer["text"][0], int(answer["answer_start"][0])
        except (KeyError, IndexError, TypeError) as exc:
            raise DataError(
                f"the {split} split's row {row}: answers must be {{'text': [...], "
                f"'answer_start': [...]}} with at least one answer, got {answer!r}"
            ) from exc
        last = first + len(text)
        inside = [t for t, (s, e) in enumerate(offsets) if s >= 0 and e > s]
        if not inside or offsets[inside[0]][0] > first or offsets[inside[-1]][1] < last:
            return 0, 0
        start = max(t for t in inside if offsets[t][0] <= first)
        end = min(t for t in inside if offsets[t][1] >= last)
        return start, end

    def loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        start_logits, end_logits = outputs.start_logits.float(), outputs.end_logits.float()
        return (
            F.cross_entropy(start_logits, batch["start_positions"])
            + F.cross_entropy(end_logits, batch["end_positions"])
        ) / 2

    def statistics(
        self, outputs: Any, batch: Mapping[str, torch.Tensor], loss: torch.Tensor
    ) -> dict[str, Any]:
        start_logits, end_logits = outputs.start_logits.float(), outputs.end_logits.float()
        # The best span inside the context: start <= end < start + max_answer_tokens.
        context = batch["offset_start"] >= 0
        masked_start = start_logits.masked_fill(~context, -1e9)
        masked_end = end_logits.masked_fill(~context, -1e9)
        scores = masked_start[:, :, None] + masked_end[:, None, :]
        length = scores.shape[-1]
        span = torch.ones(length, length, dtype=torch.bool, device=scores.device)
        span = span.triu().tril(self.max_answer_tokens - 1)
        best = scores.masked_fill(~span, -1e9).flatten(1).max(-1)
        start, end = best.indices // length, best.indices % length
        rows = torch.arange(len(start), device=start.device)
        chars = torch.stack(
            [batch["offset_start"][rows, start], batch["offset_end"][rows, end]], dim=-1
        )
        return {
            "feature_index": batch["feature_index"],
            "span_score": best.values,
            "span_chars": chars,
        }

    def metrics(self, evaluated: Evaluated) -> dict[str, float]:
        valid, device = evaluated.valid, evaluated.device
        assert isinstance(valid, Features), "QA metrics need the prepared validation features"
        # One row per validation window, filled by the rank that evaluated it; the sum over
        # ranks is the whole table, so an example's windows meet whichever ranks scored them.
        table = torch.zeros(len(valid), 4, dtype=torch.float64, device=device)
        for o in evaluated.outputs:
            table[o["feature_index"].to(device)] = torch.cat(
                [
                    torch.ones_like(o["span_score"])[:, None],
                    o["span_score"][:, None],
                    o["span_chars"].to(torch.float64),
                ],
                dim=-1,
            ).to(device=table.device, dtype=table.dtype)
        all_reduce_sum(table, evaluated.group)
        best: dict[int, tuple[float, int, int]] = {}
        for index, (scored, score, first, last) in enumerate(table.tolist()):
            if not scored:
                continue
            example = valid.rows[index]["example_index"]
            if example not in best or score > best[example][0]:
                best[example] = (score, int(first), int(last))
        contexts, answers = valid.extra["contexts"], valid.extra["answers"]
        exact = f1 = 0.0
        for example, (_, first, last) in best.items():
            prediction = contexts[example][first:last]
            exact += max(float(_normalize(prediction) == _normalize(g)) for g in answers[example])
            f1 += max(_token_f1(prediction, g) for g in answers[example])
        count = max(len(best), 1)
        return {"exact_match": 100 * exact / count, "f1": 100 * f1 / count}


def _normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _token_f1(prediction: str, truth: str) -> float:
    guess, gold = _normalize(prediction).split(), _normalize(truth).split()
    common = sum((collections.Counter(guess) & collections.Counter(gold)).values())
    if not guess or not gold:
        return float(guess == gold)
    if common == 0:
        return 0.0
    precision, recall = common / len(guess), common / len(gold)
    return 2 * precision * recall / (precision + recall)
