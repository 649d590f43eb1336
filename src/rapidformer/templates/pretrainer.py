"""The Pretrainer template: pretraining a built-in model on Megatron-style indexed data.

``--tokenizer-type`` picks the model family (:mod:`rapidformer.templates.families`): the built-in
GPT for ``GPT2BPETokenizer``, BERT for the WordPiece types. The family decides what depends on
the model; the Pretrainer owns the rest. Every hook has a default built from the flags, so
``rapidformer --task pretraining ...`` runs with no user code, and a subclass overrides only
what it changes:

- ``build_model``: the family's model, sized by ``--num-layers``, ``--hidden-size``,
  ``--num-attention-heads``, ``--max-position-embeddings`` (default ``--seq-length``) and the
  tokenizer's vocabulary, initialised on the meta device and materialised;
- ``build_data``: ``--data-path`` (one prefix or a weighted blend) split by ``--split`` into
  train / valid / test documents; train holds ``--train-iters`` x global batch samples, made
  by the family's dataset;
- the step, split for pipelines: ``model_inputs`` (token ids, and for BERT token types and the
  padding mask) and ``compute_loss``: next-token loss (GPT) or masked-LM plus sentence-order
  loss (BERT); ``batch_weight``: the tokens those losses average over;
- ``compute_metrics``: the family's evaluation metrics (masked-LM and sentence-order accuracy
  for BERT).

Pretraining is iteration-based (``--train-iters``), as in Megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.blended import BlendedDataset, samples_per_dataset
from rapidformer.data.documents import document_collate
from rapidformer.data.indexed import IndexedDataset
from rapidformer.data.splits import parse_data_path, split_ranges
from rapidformer.data.token_check import check_token_ids
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.engine.order import FEATURES
from rapidformer.errors import Violation
from rapidformer.log import log
from rapidformer.step_io import ModelInputs, call_model
from rapidformer.templates.families import CorpusSplit, family_for, family_violations
from rapidformer.templates.tasks.supervised import chat_violations
from rapidformer.templates.trainer import DataBundle, StepOutput, Trainer

if TYPE_CHECKING:
    from rapidformer.models.bert import BertModel
    from rapidformer.models.gpt import GPTModel

SPLITS = ("train", "valid", "test")


def model_family(config: RapidformerConfig) -> str:
    """The name of the family ``--tokenizer-type`` selects (``gpt``, ``bert``)."""
    return family_for(config.data.tokenizer_type).name


def build_pretraining_model(
    config: RapidformerConfig, vocab_size: int, device: str = "cpu"
) -> GPTModel | BertModel:
    """The built-in model the flags describe, initialised from --seed (left uninitialised on
    the meta device for ``device="meta"``: the engine initialises it once parallelised)."""
    model = family_for(config.data.tokenizer_type).build_model(config, vocab_size, device)
    # The annotation is what rapidformer.export converts to Hugging Face; the Pretrainer
    # itself takes any family's model (build_model asks the family directly).
    return cast("GPTModel | BertModel", model)


class Pretrainer(Trainer):
    """Pretraining template for the model families; see the module docstring."""

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
        violations += family_violations(config)
        if config.training.epochs is not None:
            violations.append(
                Violation(
                    "--epochs",
                    config.training.epochs,
                    "pretraining is iteration-based",
                    "pass --train-iters instead",
                )
            )
        violations += chat_violations(config, "pretraining")
        if cls.build_model is Pretrainer.build_model:  # built on the meta device
            violations += [v for f in FEATURES for v in f.late_weight_rules(config)]
        return violations

    def _init_template(self) -> None:
        data = self.config.data
        assert data.tokenizer_type is not None and data.vocab_file is not None
        self.tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file)
        # Looked up once, after the tokenizer: an unknown type is reported by the tokenizer.
        self.pretrain_family = family_for(data.tokenizer_type)
        """The family object every model-dependent hook delegates to."""
        self.family = self.pretrain_family.name
        self._checked_prefixes: set[str] = set()  # corpora whose token ids were checked

    # ---- hooks ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = self.pretrain_family.build_model(
            self.config, self.tokenizer.vocab_size, device="meta"
        )
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

    def _collate(self) -> Callable[..., Any]:
        """The family's collate function; with the document flags, the document boundaries
        computed on top (:mod:`rapidformer.data.documents`)."""
        cfg = self.config
        collate = self.pretrain_family.collate(self.tokenizer, cfg.model.seq_length)
        data = cfg.data
        documents = document_collate(data, self.tokenizer.eod, collate)
        if documents is None:
            return collate
        if self.engine.is_main_process:
            done = [
                what
                for what, on in (
                    ("positions restart", data.reset_position_ids),
                    ("attention stays within its document", data.reset_attention_mask),
                    ("no loss where the input is the end of a document", data.eod_mask_loss),
                )
                if on
            ]
            log.info("data: documents inside a sample: %s", "; ".join(done))
        return documents

    def model_inputs(self, batch: Any) -> ModelInputs:
        if self.config.memory.fused_lm_loss:  # the model computes its loss from the labels
            return self.pretrain_family.loss_inputs(batch)
        return self.pretrain_family.inputs(batch)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The family's loss: next-token (GPT), or masked-LM plus sentence-order (BERT)."""
        return self.pretrain_family.loss(outputs, batch)

    def batch_weight(self, batch: Any) -> int | torch.Tensor:
        """The units the family's loss averages over: every predicted token (GPT), the masked
        ones (BERT)."""
        return self.pretrain_family.weight(batch)

    def eval_step(self, batch: Any) -> StepOutput:
        assert self.model is not None
        outputs = call_model(self.model, self.model_inputs(batch))
        loss = self._loss(outputs, batch)  # compiled with the model where the run is
        return {"loss": loss, **self.pretrain_family.statistics(outputs, batch)}

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        group = self.engine.mesh.group("dp")
        return self.pretrain_family.metrics(outputs, self.device, group)

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
        split = CorpusSplit(indexed, prefix, name, start, end, num_samples, seq_length, seed)
        return self.pretrain_family.dataset(split, self.tokenizer)
