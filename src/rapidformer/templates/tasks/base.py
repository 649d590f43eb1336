"""Per-task preprocessing, batching, loss and metrics for the Finetuner.

Each fine-tuning task is one class (a module per task; this one holds what they share), and
each step of its pipeline lives in one method:

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.data import Dataset

from rapidformer.distributed.process_group import Group, sum_over_ranks
from rapidformer.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset
    from transformers import PreTrainedTokenizerBase

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
        f"its columns are {', '.join(rows.column_names)}. Fix: rename the column to "
        f"{candidates[0]!r}"
    )


def texts_of(rows: HFDataset, name: str, split: str) -> list[str]:
    """Column ``name`` of ``rows``, every value text (a tokenizer given a number fails with a
    message about its own argument types)."""
    values = list(rows[name])
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(
                f"the {split} split's {name} column holds {value!r} ({type(value).__name__}) in "
                f"row {row}, not text. Fix: write every {name} as a string (quoted in JSON)"
            )
    return values


@dataclass(frozen=True)
class Recipe:
    """A task's fine-tuning defaults where the flags leave them open: the common practice of
    the Hugging Face examples for a pretrained model of base size."""

    lr: float
    epochs: int
    warmup_fraction: float
    source: str
    """Whose practice it is (for the log line)."""

    def flags(self) -> dict[str, object]:
        return {"lr": self.lr, "epochs": self.epochs, "lr_warmup_fraction": self.warmup_fraction}


@dataclass(frozen=True)
class Evaluated:
    """What one evaluation gathered on this rank, to be summed with the other data-parallel
    ranks'."""

    outputs: list[Mapping[str, Any]]
    """The statistics of each batch this rank evaluated (empty where it evaluated none)."""
    valid: Dataset | None
    """The validation split (the features some metrics map predictions back through)."""
    device: torch.device | None
    group: Group
    """The data-parallel ranks."""

    def total(self, key: str, size: int = 1) -> torch.Tensor:
        """``key``'s statistic (a scalar, or a vector of ``size``) summed over this rank's
        batches and every rank."""
        return sum_over_ranks(self.outputs, key, self.device, self.group, size=size)


class Task:
    """What every task shares: the tokenizer, the padding rules and the step's plumbing."""

    name: ClassVar[str]
    auto_class: ClassVar[str]
    """The ``transformers`` Auto class that loads a model for this task."""
    recipe: ClassVar[Recipe]
    """Its defaults for --lr, --epochs and --lr-warmup-fraction (flags given win)."""
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
                batch[key] = pad_rows(
                    [s[key] for s in samples], length, self.pad_id if pad is None else pad
                )
            elif not isinstance(value, list):
                batch[key] = torch.tensor([s[key] for s in samples])
        return batch

    # ---- loss and metrics ----------------------------------------------------------------
    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for ``batch``."""
        return {
            k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch
        }

    def loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The batch's mean loss from the model's outputs."""
        raise NotImplementedError

    def weight(self, batch: Mapping[str, torch.Tensor]) -> int | torch.Tensor:
        """The units :meth:`loss` averages over, from the batch alone: its samples, unless the
        task's loss is a mean over tokens."""
        return int(batch["input_ids"].shape[0])

    def statistics(
        self, outputs: Any, batch: Mapping[str, torch.Tensor], loss: torch.Tensor
    ) -> dict[str, Any]:
        """What :meth:`metrics` needs from one evaluated batch (sums and counts), given its
        ``loss``."""
        return {}

    def metrics(self, evaluated: Evaluated) -> dict[str, float]:
        """Metrics from this rank's eval outputs summed with the other data-parallel ranks'
        (:meth:`Evaluated.total`). Every rank calls it, also one that evaluated no batch (its
        outputs are empty)."""
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
        # str(None) would make a class "None"; a ClassLabel marks a missing label -1.
        negative_ok = names is None  # only a ClassLabel's -1 means "no label"
        missing = [v is None or (not negative_ok and isinstance(v, int) and v < 0) for v in values]
        unlabelled = [row_of[i] if row_of else i for i, gone in enumerate(missing) if gone]
        if unlabelled:
            raise DataError(
                f"the {split} split has {len(unlabelled)} rows without a label (null), the "
                f"first: {', '.join(map(str, unlabelled[:5]))}. Fix: label them, or drop them"
            )
        if self.labels is None:
            if names is not None:  # a ClassLabel feature: its names, in its order
                self.labels = list(names)
            else:
                self.labels = [str(v) for v in sorted(set(values), key=_label_order)]
            if len(self.labels) < 2:  # the loss is 0 from the first step: nothing to learn
                raise DataError(
                    f"the {split} split has a single label ({', '.join(self.labels)!s}): a "
                    "classifier of one class learns nothing. Fix: add examples of the other "
                    "classes"
                )
        ids = {name: i for i, name in enumerate(self.labels)}
        out: list[int] = []
        for row, value in enumerate(values):
            key = names[value] if names is not None and isinstance(value, int) else str(value)
            if key not in ids:
                where = row_of[row] if row_of is not None else row
                raise DataError(
                    f"the {split} split has label {value!r} (row {where}) that the training "
                    f"split does not have; known labels: {', '.join(self.labels)}. Fix: add "
                    "training examples of it, or drop those rows"
                )
            out.append(ids[key])
        return out


def encoded_rows(encoded: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    """Column lists -> one dict per row."""
    count = len(encoded["input_ids"])
    return [{key: values[i] for key, values in encoded.items()} for i in range(count)]


def _label_order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, int) else (1, str(value))


def pad_rows(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    length = max(length, max(len(r) for r in rows))
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def class_names(rows: HFDataset, name: str, nested: bool = False) -> list[str] | None:
    feature = rows.features.get(name)
    if nested:
        feature = getattr(feature, "feature", None)
    names = getattr(feature, "names", None)
    return list(names) if names else None
