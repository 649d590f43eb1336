"""Per-task preprocessing, batching, loss and metrics for the Finetuner.

Each fine-tuning task is one class here, and each step of its pipeline lives in one method:

* ``prepare``: rows of a ``datasets`` split -> tokenized :class:`Features` (with ``lengths``),
  checking columns and labels and naming what is wrong;
* ``collate``: features -> padded tensors; pads to ``--seq-length``, or to ``pad_to`` when the
  dynamic-shape iterator chooses a bucket;
* ``step``: the model's loss on a batch, weighted by samples or tokens, plus the sufficient
  statistics (counts, sums, confusion counts) of the task's metrics;
* ``metrics``: those statistics summed over the evaluated batches and all-reduced over ranks,
  then turned into metrics. Evaluation gives each rank a disjoint share of the validation set,
  so the sums count each sample exactly once; per-rank metrics are never averaged.

Task specifics: token classification labels each word's first sub-token (the rest are ignored);
question answering splits long contexts into windows with a document stride and maps answer
characters to token spans with the tokenizer's offsets, then scores each *example* by its best
span over all its windows, wherever those were evaluated; masked-LM masks 15% of the tokens
(80% [MASK], 10% random, 10% kept), afresh for every training batch and fixed per sample for
validation; causal-LM predicts token t+1 from tokens up to t; seq2seq predicts the target with
teacher forcing (the model shifts the labels right to build the decoder input).
"""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from rapidformer.distributed import process_group
from rapidformer.distributed.process_group import sum_over_ranks
from rapidformer.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
TASKS = (
    "sequence_classification",
    "token_classification",
    "question_answering",
    "masked_lm",
    "causal_lm",
    "seq2seq_lm",
)
"""The fine-tuning tasks; ``casual_lm`` (the reference tool's spelling) means ``causal_lm``."""


def canonical_task(name: str) -> str:
    return "causal_lm" if name == "casual_lm" else name


class Features(Dataset):
    """Tokenized samples of one split: a list of dicts of ints / int lists, and ``lengths``
    (tokens per sample) for the dynamic-shape iterator."""

    def __init__(self, rows: list[dict[str, Any]], split: str, **extra: Any) -> None:
        self.rows = rows
        self.split = split
        self.lengths = [len(row["input_ids"]) for row in rows]
        self.extra = extra
        """Task data that is not a tensor (e.g. QA contexts and answers for scoring)."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def column(rows: HFDataset, candidates: Sequence[str], split: str, what: str) -> str:
    """The first of ``candidates`` that ``rows`` has, or an error naming what is missing."""
    for name in candidates:
        if name in rows.column_names:
            return name
    raise DataError(
        f"the {split} split has no {what} column: looked for {', '.join(candidates)}; "
        f"its columns are {', '.join(rows.column_names)}"
    )


class Task:
    """What every task shares: the tokenizer, the padding rules and the step's plumbing."""

    name: ClassVar[str]
    auto_class: ClassVar[str]
    """The ``transformers`` Auto class that loads a model for this task."""
    sequence_keys: ClassVar[dict[str, int | None]] = {
        "input_ids": None,  # None: the tokenizer's pad id
        "attention_mask": 0,
        "token_type_ids": 0,
    }
    """Keys padded along the sequence, with their padding value."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_length: int, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.seed = seed
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.labels: list[str] | None = None
        """Label names in id order (classification tasks), learned from the training split."""

    # ---- preprocessing -------------------------------------------------------------------
    def prepare(self, rows: HFDataset, split: str) -> Features:
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``from_pretrained`` (the label set, where there is one)."""
        if self.labels is None:
            return {}
        return {
            "num_labels": len(self.labels),
            "id2label": dict(enumerate(self.labels)),
            "label2id": {name: i for i, name in enumerate(self.labels)},
        }

    def _encode(self, texts: list[str], pairs: list[str] | None = None) -> dict[str, list[Any]]:
        encoded = self.tokenizer(texts, pairs, truncation=True, max_length=self.seq_length)
        return {k: v for k, v in encoded.items() if k in self.sequence_keys}

    # ---- batching ------------------------------------------------------------------------
    def collate(self, samples: list[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        length = pad_to or self.seq_length
        batch: dict[str, torch.Tensor] = {}
        for key, value in samples[0].items():
            if isinstance(value, list) and key in self.sequence_keys:
                pad = self.sequence_keys[key]
                batch[key] = _pad(
                    [s[key] for s in samples], length, self.pad_id if pad is None else pad
                )
            elif not isinstance(value, list):
                batch[key] = torch.tensor([s[key] for s in samples])
        return batch

    # ---- loss and metrics ----------------------------------------------------------------
    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch
        }

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        raise NotImplementedError

    def metrics(
        self,
        outputs: list[Mapping[str, Any]],
        valid: Dataset | None,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        """Metrics from this rank's eval outputs summed with every other rank's. Every rank
        calls it, also one that evaluated no batch (its outputs are empty)."""
        raise NotImplementedError

    def _labels_from(
        self,
        values: list[Any],
        split: str,
        names: list[str] | None,
        row_of: list[int] | None = None,
    ) -> list[int]:
        """Label ids of ``values``; the training split defines the label set. ``row_of`` maps
        a value's index to its row when rows hold several values (token tags)."""
        if self.labels is None:
            if names is not None:  # a ClassLabel feature: its names, in its order
                self.labels = list(names)
            else:
                self.labels = [str(v) for v in sorted(set(values), key=_label_order)]
        ids = {name: i for i, name in enumerate(self.labels)}
        out: list[int] = []
        for row, value in enumerate(values):
            key = names[value] if names is not None and isinstance(value, int) else str(value)
            if key not in ids:
                where = row_of[row] if row_of is not None else row
                raise DataError(
                    f"the {split} split has label {value!r} (row {where}) that the training "
                    f"split does not have; known labels: {', '.join(self.labels)}"
                )
            out.append(ids[key])
        return out


def _rows(encoded: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    """Column lists -> one dict per row."""
    count = len(encoded["input_ids"])
    return [{key: values[i] for key, values in encoded.items()} for i in range(count)]


def _label_order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, int) else (1, str(value))


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    length = max(length, max(len(r) for r in rows))
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _class_names(rows: HFDataset, name: str, nested: bool = False) -> list[str] | None:
    feature = rows.features.get(name)
    if nested:
        feature = getattr(feature, "feature", None)
    names = getattr(feature, "names", None)
    return list(names) if names else None


# ---- sequence classification -------------------------------------------------------------
class SequenceClassification(Task):
    """One label per text (or text pair): accuracy and macro F1 from a confusion matrix."""

    name = "sequence_classification"
    auto_class = "AutoModelForSequenceClassification"
    TEXT = ("text", "sentence", "sentence1", "question", "premise")
    PAIR = ("text_pair", "sentence2", "hypothesis")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        text = column(rows, self.TEXT, split, "text")
        label = column(rows, ("label", "labels"), split, "label")
        pair = next((c for c in self.PAIR if c in rows.column_names), None)
        encoded = self._encode(list(rows[text]), list(rows[pair]) if pair else None)
        labels = self._labels_from(list(rows[label]), split, _class_names(rows, label))
        features = [
            {**{k: v[i] for k, v in encoded.items()}, "labels": labels[i]}
            for i in range(len(labels))
        ]
        return Features(features, split)

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        logits = model(**self.inputs(batch)).logits.float()
        labels = batch["labels"]
        k = logits.shape[-1]
        confusion = torch.bincount(labels * k + logits.argmax(-1), minlength=k * k)
        return {"loss": F.cross_entropy(logits, labels), "confusion": confusion}

    def metrics(
        self,
        outputs: list[Mapping[str, Any]],
        valid: Dataset | None,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        assert self.labels is not None
        k = len(self.labels)
        confusion = sum_over_ranks(outputs, "confusion", device, size=k * k).view(
            k, k
        )  # rows: true label, columns: predicted
        true_positive = confusion.diagonal()
        precision = true_positive / confusion.sum(0).clamp(min=1)
        recall = true_positive / confusion.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        present = (confusion.sum(0) + confusion.sum(1)) > 0  # macro over labels that occur
        return {
            "accuracy": float(true_positive.sum() / confusion.sum().clamp(min=1)),
            "f1": float(f1[present].mean()) if present.any() else 0.0,
        }


# ---- token classification ----------------------------------------------------------------
class TokenClassification(Task):
    """One tag per word; the word's first sub-token carries it. Entity-level F1 (an entity
    counts when its type and exact word span match), as seqeval computes it for IOB tags."""

    name = "token_classification"
    auto_class = "AutoModelForTokenClassification"
    sequence_keys: ClassVar[dict[str, int | None]] = {**Task.sequence_keys, "labels": IGNORE_INDEX}

    def prepare(self, rows: HFDataset, split: str) -> Features:
        words = column(rows, ("tokens", "words"), split, "tokens (list of words)")
        tags = column(rows, ("ner_tags", "tags", "labels", "pos_tags"), split, "tags")
        sentences = [list(s) for s in rows[words]]
        tag_rows = list(rows[tags])
        flat = [t for row in tag_rows for t in row]
        row_of = [i for i, row in enumerate(tag_rows) for _ in row]
        names = _class_names(rows, tags, nested=True)
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

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        logits = model(**self.inputs(batch)).logits.float()
        labels = batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        scored = labels != IGNORE_INDEX
        if not evaluate:
            return {"loss": loss, "num_tokens": scored.sum()}
        predicted = logits.argmax(-1)
        assert self.labels is not None
        counts = torch.zeros(3, dtype=torch.long)  # matched, predicted, gold entities
        for row in range(labels.shape[0]):
            mask = scored[row]
            gold = entities([self.labels[i] for i in labels[row][mask].tolist()])
            guess = entities([self.labels[i] for i in predicted[row][mask].tolist()])
            counts += torch.tensor([len(gold & guess), len(guess), len(gold)])
        return {
            "loss": loss,
            "num_tokens": scored.sum(),
            "correct": ((predicted == labels) & scored).sum(),
            "entities": counts,
        }

    def metrics(
        self,
        outputs: list[Mapping[str, Any]],
        valid: Dataset | None,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        matched, predicted, gold = sum_over_ranks(outputs, "entities", device, size=3).tolist()
        correct, tokens = (
            sum_over_ranks(outputs, "correct", device),
            sum_over_ranks(outputs, "num_tokens", device),
        )
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


# ---- question answering ------------------------------------------------------------------
class QuestionAnswering(Task):
    """Extractive QA (SQuAD format). Contexts longer than the window are split into windows
    that overlap by ``doc_stride`` tokens; a window whose context does not hold the answer
    points at the first token. Scored per example by exact match and token F1, SQuAD's way."""

    name = "question_answering"
    auto_class = "AutoModelForQuestionAnswering"
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

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        out = model(**self.inputs(batch))
        start_logits, end_logits = out.start_logits.float(), out.end_logits.float()
        loss = (
            F.cross_entropy(start_logits, batch["start_positions"])
            + F.cross_entropy(end_logits, batch["end_positions"])
        ) / 2
        if not evaluate:
            return {"loss": loss}
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
            "loss": loss,
            "feature_index": batch["feature_index"],
            "span_score": best.values,
            "span_chars": chars,
        }

    def metrics(
        self,
        outputs: list[Mapping[str, Any]],
        valid: Dataset | None,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        assert isinstance(valid, Features), "QA metrics need the prepared validation features"
        # One row per validation window, filled by the rank that evaluated it; the sum over
        # ranks is the whole table, so an example's windows meet whichever ranks scored them.
        table = torch.zeros(len(valid), 4, dtype=torch.float64, device=device)
        for o in outputs:
            table[o["feature_index"].to(device)] = torch.cat(
                [
                    torch.ones_like(o["span_score"])[:, None],
                    o["span_score"][:, None],
                    o["span_chars"].to(torch.float64),
                ],
                dim=-1,
            ).to(device=table.device, dtype=table.dtype)
        process_group.all_reduce_sum(table)
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


# ---- language modelling ------------------------------------------------------------------
class LanguageModeling(Task):
    """Shared by the three LM tasks: token-weighted loss, perplexity, token accuracy."""

    sequence_keys: ClassVar[dict[str, int | None]] = {**Task.sequence_keys, "labels": IGNORE_INDEX}
    TEXT = ("text", "content", "sentence", "document")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        text = column(rows, self.TEXT, split, "text")
        encoded = self._encode(list(rows[text]))
        features = _rows(encoded)
        return Features([f for f in features if len(f["input_ids"]) > 1], split)

    @staticmethod
    def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = logits.float()
        scored = labels != IGNORE_INDEX
        tokens = scored.sum()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return {
            "loss": loss,
            "num_tokens": tokens,
            "loss_sum": loss.detach() * tokens,
            "correct": ((logits.argmax(-1) == labels) & scored).sum(),
        }

    def metrics(
        self,
        outputs: list[Mapping[str, Any]],
        valid: Dataset | None,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        loss_sum = sum_over_ranks(outputs, "loss_sum", device)
        tokens = sum_over_ranks(outputs, "num_tokens", device).clamp(min=1)
        correct = sum_over_ranks(outputs, "correct", device)
        return {
            "perplexity": math.exp(min(float(loss_sum / tokens), 50.0)),
            "token_accuracy": float(correct / tokens),
        }


class MaskedLM(LanguageModeling):
    """Masked-LM: 15% of the non-special tokens are predicted (80% shown as the mask token,
    10% as a random token, 10% unchanged)."""

    name = "masked_lm"
    auto_class = "AutoModelForMaskedLM"
    probability = 0.15

    def prepare(self, rows: HFDataset, split: str) -> Features:
        if self.tokenizer.mask_token_id is None:
            raise DataError("masked_lm needs a tokenizer with a mask token (e.g. BERT's [MASK])")
        features = super().prepare(rows, split)
        if split != "train":  # validation masks are fixed, so every evaluation scores the same
            rng = torch.Generator().manual_seed(self.seed + 1)
            for row in features.rows:
                ids, labels = self.mask(torch.tensor([row["input_ids"]]), rng)
                row["input_ids"], row["labels"] = ids[0].tolist(), labels[0].tolist()
        return features

    def mask(
        self, input_ids: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked inputs and labels (the original ids where masked, else ignored)."""
        special = torch.tensor(
            [
                self.tokenizer.get_special_tokens_mask(r, already_has_special_tokens=True)
                for r in input_ids.tolist()
            ],
            dtype=torch.bool,
        ) | (input_ids == self.pad_id)
        draw = torch.rand(input_ids.shape, generator=generator)
        chosen = (draw < self.probability) & ~special
        labels = torch.where(chosen, input_ids, IGNORE_INDEX)
        action = torch.rand(input_ids.shape, generator=generator)
        ids = input_ids.clone()
        ids[chosen & (action < 0.8)] = int(self.tokenizer.mask_token_id)
        replace = chosen & (action >= 0.8) & (action < 0.9)
        vocab = len(self.tokenizer)
        ids[replace] = torch.randint(vocab, (int(replace.sum()),), generator=generator)
        return ids, labels

    def collate(self, samples: list[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        batch = super().collate(samples, pad_to)
        if "labels" not in batch:  # training rows: fresh masks for every batch
            batch["input_ids"], batch["labels"] = self.mask(batch["input_ids"])
        return batch

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        return self._token_loss(model(**self.inputs(batch)).logits, batch["labels"])


class CausalLM(LanguageModeling):
    """Causal LM: each token predicts the next; padding is never a target."""

    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"

    def _encode(self, texts: list[str], pairs: list[str] | None = None) -> dict[str, list[Any]]:
        eos = self.tokenizer.eos_token
        # End each text with the end-of-sequence token, so the model learns where texts stop.
        texts = [t + eos if eos and not t.endswith(eos) else t for t in texts]
        return super()._encode(texts)

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        logits = model(**self.inputs(batch)).logits
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        # The shift: position t's logits score token t + 1.
        return self._token_loss(logits[:, :-1], labels[:, 1:])


class Seq2SeqLM(LanguageModeling):
    """Sequence to sequence: the encoder reads the source, the decoder predicts the target."""

    name = "seq2seq_lm"
    auto_class = "AutoModelForSeq2SeqLM"
    SOURCE = ("source", "input", "document", "text", "src")
    TARGET = ("target", "output", "summary", "label", "tgt")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        source = column(rows, self.SOURCE, split, "source")
        target = column(rows, self.TARGET, split, "target")
        encoded = self._encode(list(rows[source]))
        targets = self.tokenizer(
            text_target=list(rows[target]), truncation=True, max_length=self.seq_length
        )["input_ids"]
        features = [{**row, "target": targets[i]} for i, row in enumerate(_rows(encoded))]
        return Features(features, split)

    def collate(self, samples: list[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        batch = super().collate(samples, pad_to)
        targets = [s["target"] for s in samples]
        longest = max(len(t) for t in targets)
        # Targets: the fixed length, or (dynamic shape) their longest rounded up to 8 tokens.
        length = -(-longest // 8) * 8 if pad_to else self.seq_length
        batch["labels"] = _pad(targets, length, IGNORE_INDEX)
        return batch

    def step(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], evaluate: bool = False
    ) -> dict[str, Any]:
        logits = model(**self.inputs(batch), labels=batch["labels"]).logits
        return self._token_loss(logits, batch["labels"])


TASK_CLASSES: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        SequenceClassification,
        TokenClassification,
        QuestionAnswering,
        MaskedLM,
        CausalLM,
        Seq2SeqLM,
    )
}


def task_for(name: str) -> type[Task]:
    return TASK_CLASSES[canonical_task(name)]


__all__ = ["IGNORE_INDEX", "TASKS", "Features", "Task", "canonical_task", "entities", "task_for"]
