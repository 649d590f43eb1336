"""The Pretrainer template: GPT or BERT pretraining on Megatron-style indexed data.

Every hook has a default built from the flags, so ``rapidformer --task pretraining ...`` runs
with no user code, and a subclass overrides only what it changes:

- ``build_model``: the built-in GPT (``--tokenizer-type GPT2BPETokenizer``) or BERT (the
  WordPiece tokenizer types), sized by ``--num-layers``, ``--hidden-size``,
  ``--num-attention-heads``, ``--max-position-embeddings`` (default ``--seq-length``) and the
  tokenizer's vocabulary, initialised on the meta device and materialised;
- ``build_data``: ``--data-path`` (one prefix or a weighted blend) split by ``--split`` into
  train / valid / test documents; train holds ``--train-iters`` x global batch samples;
- the step, split for pipelines: ``model_inputs`` (token ids, and for BERT token types and the
  padding mask) and ``compute_loss``: next-token loss (GPT) or masked-LM plus sentence-order
  loss (BERT); ``batch_weight``: the tokens those losses average over;
- ``compute_metrics``: masked-LM accuracy for BERT.

Pretraining is iteration-based (``--train-iters``), as in Megatron.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, default_collate

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.bert_dataset import IGNORE_INDEX, BertDataset, bert_collate
from rapidformer.data.blended import BlendedDataset, samples_per_dataset
from rapidformer.data.gpt_dataset import GPTDataset
from rapidformer.data.indexed import IndexedDataset
from rapidformer.data.splits import parse_data_path, split_ranges
from rapidformer.data.token_check import check_token_ids
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.distributed import process_group
from rapidformer.errors import Violation
from rapidformer.logging import log
from rapidformer.models.bert import BertConfig, BertModel
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import ModelInputs, call_model, local_loss, whole
from rapidformer.templates.trainer import DataBundle, StepOutput, Trainer

SPLITS = ("train", "valid", "test")


def model_family(config: RapidformerConfig) -> str:
    """``gpt`` for the GPT-2 BPE tokenizer, ``bert`` for the WordPiece ones."""
    return "gpt" if config.data.tokenizer_type == "GPT2BPETokenizer" else "bert"


def build_pretraining_model(
    config: RapidformerConfig, vocab_size: int, device: str = "cpu"
) -> GPTModel | BertModel:
    """The built-in model the flags describe, initialised from --seed (left uninitialised on
    the meta device for ``device="meta"``: the engine initialises it once parallelised)."""
    model = config.model
    assert model.num_layers and model.hidden_size and model.num_attention_heads
    assert model.seq_length is not None
    positions = model.max_position_embeddings or model.seq_length
    if model_family(config) == "gpt":
        gpt = GPTConfig(
            vocab_size=vocab_size,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            max_position_embeddings=positions,
            dropout=model.hidden_dropout,
        )
        return GPTModel.build(gpt, device=device, seed=config.training.seed)
    bert = BertConfig(
        vocab_size=vocab_size,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        max_position_embeddings=positions,
        dropout=model.hidden_dropout,
    )
    return BertModel.build(bert, device=device, seed=config.training.seed)


class Pretrainer(Trainer):
    """GPT/BERT pretraining template; see the module docstring."""

    @classmethod
    def config_violations(cls, config: RapidformerConfig) -> list[Violation]:
        required = {
            "--data-path": config.data.data_path,
            "--tokenizer-type": config.data.tokenizer_type,
            "--vocab-file": config.data.vocab_file,
            "--seq-length": config.model.seq_length,
            "--num-layers": config.model.num_layers,
            "--hidden-size": config.model.hidden_size,
            "--num-attention-heads": config.model.num_attention_heads,
        }
        violations = super().config_violations(config)
        violations += [
            Violation(flag, None, "pretraining needs it", f"pass {flag}")
            for flag, value in required.items()
            if value is None
        ]
        if config.data.tokenizer_type == "GPT2BPETokenizer" and config.data.merge_file is None:
            violations.append(
                Violation(
                    "--merge-file",
                    None,
                    "the GPT-2 BPE tokenizer needs its merges file",
                    "pass --merge-file merges.txt",
                )
            )
        if config.training.epochs is not None:
            violations.append(
                Violation(
                    "--epochs",
                    config.training.epochs,
                    "pretraining is iteration-based",
                    "pass --train-iters instead",
                )
            )
        return violations

    def __init__(
        self, config: RapidformerConfig | None = None, argv: Sequence[str] | None = None
    ) -> None:
        super().__init__(config, argv)
        data = self.config.data
        assert data.tokenizer_type is not None and data.vocab_file is not None
        self.tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file)
        self.family = model_family(self.config)
        self._checked_prefixes: set[str] = set()  # corpora whose token ids were checked

    # ---- hooks ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = build_pretraining_model(self.config, self.tokenizer.vocab_size, device="meta")
        if self.engine.is_main_process:
            parameters = sum(p.numel() for p in model.parameters())
            log.info(
                "model: built-in %s, %s, %s parameters",
                self.family.upper(),
                model.config,
                f"{parameters:,}",
            )
        return model

    def build_data(self) -> DataBundle:
        cfg = self.config
        global_batch = self.engine.dims.global_batch_size(
            cfg.data.micro_batch_size, cfg.data.global_batch_size
        )
        assert cfg.training.train_iters is not None
        eval_batches = cfg.training.eval_iters
        evaluations = cfg.training.train_iters // (cfg.training.eval_interval or 10**12) + 1
        wanted: dict[str, int | None] = {
            "train": cfg.training.train_iters * global_batch,
            # None: the whole split once (the default when --eval-iters is not given).
            "valid": None if eval_batches is None else evaluations * eval_batches * global_batch,
            "test": None if eval_batches is None else eval_batches * global_batch,
        }
        assert cfg.data.data_path is not None
        blend = parse_data_path(cfg.data.data_path)
        datasets = {name: self._blended(blend, name, wanted[name]) for name in SPLITS}
        return DataBundle(
            train=datasets["train"],
            valid=datasets["valid"],
            test=datasets["test"],
            collate_fn=self._collate(),
        )

    def model_inputs(self, batch: Any) -> ModelInputs:
        if self.family == "gpt":
            return (batch["input_ids"],)
        return (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """Next-token loss (GPT), or masked-LM plus sentence-order loss (BERT)."""
        if self.family == "gpt":
            return F.cross_entropy(outputs.float().flatten(0, 1), batch["labels"].flatten())
        mlm_logits, sop_logits = outputs
        mlm_loss = F.cross_entropy(
            mlm_logits.float().flatten(0, 1),
            batch["mlm_labels"].flatten(),
            ignore_index=IGNORE_INDEX,
        )
        # Under tensor parallelism the MLM loss is a replicated DTensor (vocab-parallel).
        return local_loss(mlm_loss) + F.cross_entropy(sop_logits.float(), batch["sop_label"])

    def batch_weight(self, batch: Any) -> int | torch.Tensor:
        """Tokens: every predicted token (GPT), the masked ones (BERT: the MLM term dominates;
        the sentence-order term rides along per sample)."""
        if self.family == "gpt":
            return int(batch["labels"].numel())
        return (batch["mlm_labels"] != IGNORE_INDEX).sum()

    def eval_step(self, batch: Any) -> StepOutput:
        assert self.model is not None
        outputs = call_model(self.model, self.model_inputs(batch))
        loss = self.compute_loss(outputs, batch)
        if self.family == "gpt":
            return {"loss": loss}
        mlm_logits, sop_logits = whole(outputs[0]), outputs[1]  # vocab shards gathered
        labels = batch["mlm_labels"]
        predicted = labels != IGNORE_INDEX
        return {
            "loss": loss,
            "num_tokens": predicted.sum(),
            "mlm_correct": ((mlm_logits.argmax(-1) == labels) & predicted).sum(),
            "sop_correct": (sop_logits.argmax(-1) == batch["sop_label"]).sum(),
            "samples": torch.tensor(labels.shape[0]),
        }

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        if self.family != "bert":
            return {}
        # Every rank sums, even one without validation batches: the all-reduce must not hang.
        group = self.engine.mesh.group("dp")
        mlm_correct, masked, sop_correct, samples = (
            float(process_group.sum_over_ranks(outputs, key, self.device, group))
            for key in ("mlm_correct", "num_tokens", "sop_correct", "samples")
        )
        return {
            "mlm_accuracy": mlm_correct / max(masked, 1.0),
            "sop_accuracy": sop_correct / max(samples, 1.0),
        }

    # ---- plumbing ------------------------------------------------------------------------
    def _blended(
        self, blend: list[tuple[float, str]], name: str, num_samples: int | None
    ) -> Dataset | None:
        if name != "train" and not all(self._has_documents(prefix, name) for _, prefix in blend):
            return None  # e.g. the 1/1000 test share of a small corpus: no such split
        if len(blend) == 1:
            return self._split_dataset(blend[0][1], name, num_samples)
        if num_samples is None:  # one pass over every corpus, no reweighting
            parts = [self._split_dataset(prefix, name, None) for _, prefix in blend]
            sizes = [len(part) for part in parts]  # type: ignore[arg-type]
            weights = [size / sum(sizes) for size in sizes]
            return BlendedDataset(parts, weights, sum(sizes))
        weights = [weight for weight, _ in blend]
        counts = samples_per_dataset(weights, num_samples)
        parts = [
            self._split_dataset(prefix, name, max(count, 1))
            for (_, prefix), count in zip(blend, counts, strict=True)
        ]
        return BlendedDataset(parts, weights, num_samples)

    def _split_range(self, prefix: str, name: str) -> tuple[IndexedDataset, int, int]:
        indexed = IndexedDataset(prefix, self.config.data.data_impl)
        if prefix not in self._checked_prefixes:
            vocab_file = self.config.data.vocab_file or ""
            check_token_ids(indexed.bin_path, indexed.dtype, self.tokenizer.vocab_size, vocab_file)
            self._checked_prefixes.add(prefix)
        num_documents = len(indexed.doc_idx) - 1
        start, end = split_ranges(num_documents, self.config.data.split)[SPLITS.index(name)]
        return indexed, start, end

    def _has_documents(self, prefix: str, name: str) -> bool:
        _, start, end = self._split_range(prefix, name)
        return end > start

    def _split_dataset(self, prefix: str, name: str, num_samples: int | None) -> Dataset:
        cfg = self.config
        indexed, start, end = self._split_range(prefix, name)
        seq_length = cfg.model.seq_length
        assert seq_length is not None
        seed = cfg.training.seed + SPLITS.index(name)
        if self.family == "gpt":
            return GPTDataset(indexed, prefix, name, start, end, num_samples, seq_length, seed)
        tokenizer = self.tokenizer
        assert tokenizer.cls is not None and tokenizer.sep is not None
        assert tokenizer.mask is not None
        return BertDataset(
            indexed,
            prefix,
            name,
            start,
            end,
            num_samples,
            seq_length,
            seed,
            cls=tokenizer.cls,
            sep=tokenizer.sep,
            mask=tokenizer.mask,
            vocab_size=tokenizer.vocab_size,
        )

    def _collate(self) -> Any:
        if self.family == "gpt":
            return default_collate  # every GPT sample has --seq-length tokens
        # Fixed shape pads to --seq-length; the dynamic-shape iterator passes a bucket instead.
        return functools.partial(
            bert_collate, pad_id=self.tokenizer.pad, pad_to=self.config.model.seq_length
        )
