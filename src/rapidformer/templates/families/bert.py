"""BERT pretraining: masked-LM plus sentence-order prediction over sentence pairs.

Selected by the WordPiece ``--tokenizer-type`` values. Samples are ``[CLS] A [SEP] B [SEP]``
pairs of up to ``--seq-length`` tokens with some tokens masked; the loss is the masked-LM
cross-entropy over the masked tokens plus the sentence-order cross-entropy over the samples,
and evaluation reports both accuracies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.bert_dataset import BertDataset, bert_collate
from rapidformer.data.tokenizers import RapidTokenizer
from rapidformer.distributed import process_group
from rapidformer.distributed.process_group import Group
from rapidformer.errors import Violation
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.bert import BertConfig, BertModel
from rapidformer.step_io import ModelInputs, local_loss, whole
from rapidformer.templates.families.base import CorpusSplit, PretrainFamily, model_shape
from rapidformer.templates.families.gpt import document_violations


class BertFamily(PretrainFamily):
    """The built-in :class:`~rapidformer.models.bert.BertModel` with its pretraining heads."""

    name = "bert"
    tokenizer_types = ("BertWordPieceLowerCase", "BertWordPieceCase")

    def config_violations(self, config: RapidformerConfig) -> list[Violation]:
        return document_violations(config, "bert")

    def build_model(self, config: RapidformerConfig, vocab_size: int, device: str) -> nn.Module:
        shape = BertConfig(**model_shape(config, vocab_size))
        return BertModel.build(shape, device=device, seed=config.training.seed)

    def dataset(self, split: CorpusSplit, tokenizer: RapidTokenizer) -> Dataset:
        assert tokenizer.cls is not None and tokenizer.sep is not None
        assert tokenizer.mask is not None
        return BertDataset(
            split,
            cls=tokenizer.cls,
            sep=tokenizer.sep,
            mask=tokenizer.mask,
            vocab_size=tokenizer.vocab_size,
        )

    def collate(self, tokenizer: RapidTokenizer, seq_length: int | None) -> Callable[..., Any]:
        # Fixed shape pads to --seq-length; the dynamic-shape iterator passes a bucket instead.
        return functools.partial(bert_collate, pad_id=tokenizer.pad, pad_to=seq_length)

    def inputs(self, batch: Any) -> ModelInputs:
        return (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])

    def loss_inputs(self, batch: Any) -> ModelInputs:
        return (*self.inputs(batch), batch["mlm_labels"])

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        mlm_logits, sop_logits = outputs
        if mlm_logits.ndim == 0:  # --fused-lm-loss: the model computed the MLM loss
            mlm_loss = mlm_logits
        else:
            mlm_loss = F.cross_entropy(
                mlm_logits.float().flatten(0, 1),
                batch["mlm_labels"].flatten(),
                ignore_index=IGNORE_INDEX,
            )
        # Under tensor parallelism the MLM loss is a replicated DTensor (vocab-parallel).
        return local_loss(mlm_loss) + F.cross_entropy(sop_logits.float(), batch["sop_label"])

    def example_batch(self, micro_batch: int, seq_length: int, device: str) -> dict[str, Any]:
        def tokens() -> torch.Tensor:
            return torch.zeros(micro_batch, seq_length, dtype=torch.long, device=device)

        return {
            "input_ids": tokens(),
            "token_type_ids": tokens(),
            "attention_mask": tokens(),
            "mlm_labels": tokens(),
            "sop_label": torch.zeros(micro_batch, dtype=torch.long, device=device),
        }

    def weight(self, batch: Any) -> int | torch.Tensor:
        """The masked tokens: the MLM term dominates; the sentence-order term rides along per
        sample."""
        return (batch["mlm_labels"] != IGNORE_INDEX).sum()

    def statistics(self, outputs: Any, batch: Any) -> dict[str, Any]:
        mlm_logits, sop_logits = whole(outputs[0]), outputs[1]  # vocab shards gathered
        labels = batch["mlm_labels"]
        predicted = labels != IGNORE_INDEX
        return {
            "num_tokens": predicted.sum(),
            "mlm_correct": ((mlm_logits.argmax(-1) == labels) & predicted).sum(),
            "sop_correct": (sop_logits.argmax(-1) == batch["sop_label"]).sum(),
            "samples": torch.tensor(labels.shape[0]),
        }

    def metrics(
        self, outputs: list[Mapping[str, Any]], device: torch.device | None, group: Group
    ) -> dict[str, float]:
        mlm_correct, masked, sop_correct, samples = (
            float(process_group.sum_over_ranks(outputs, key, device, group))
            for key in ("mlm_correct", "num_tokens", "sop_correct", "samples")
        )
        return {
            "mlm_accuracy": mlm_correct / max(masked, 1.0),
            "sop_accuracy": sop_correct / max(samples, 1.0),
        }
