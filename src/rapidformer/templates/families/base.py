"""What a pretraining model family is: the interface the Pretrainer delegates to.

A family (GPT, BERT, ...) decides everything about pretraining that depends on the model: which
``--tokenizer-type`` values select it, the model the flags describe, the dataset that turns a
corpus's documents into samples, how samples are batched, the step split for pipelines (model
inputs, loss, the units the loss averages over) and what evaluation reports beyond the loss.
The Pretrainer owns what does not depend on it (splits, blends, token-id checks, the loop), so
adding a family is a module and a registry entry in :mod:`rapidformer.templates.families`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypedDict

import torch
from torch import nn
from torch.utils.data import Dataset

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.splits import CorpusSplit
from rapidformer.data.tokenizers import RapidTokenizer
from rapidformer.distributed.process_group import Group
from rapidformer.errors import Violation
from rapidformer.step_io import ModelInputs


class ModelShape(TypedDict):
    """The sizes every built-in model config takes, read from the model flags."""

    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    dropout: float


def model_shape(config: RapidformerConfig, vocab_size: int) -> ModelShape:
    """``--num-layers``, ``--hidden-size``, ``--num-attention-heads``,
    ``--max-position-embeddings`` (default ``--seq-length``), ``--hidden-dropout`` and the
    tokenizer's vocabulary size."""
    model = config.model
    assert model.num_layers and model.hidden_size and model.num_attention_heads
    assert model.seq_length is not None
    return ModelShape(
        vocab_size=vocab_size,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
        dropout=model.hidden_dropout,
    )


class PretrainFamily(ABC):
    """A model family the Pretrainer can pretrain; one stateless instance per family."""

    name: ClassVar[str]
    """Short name, e.g. ``gpt``; the registry key, upper-cased in the model log line."""
    tokenizer_types: ClassVar[tuple[str, ...]]
    """The ``--tokenizer-type`` values that select this family."""

    def config_violations(self, config: RapidformerConfig) -> list[Violation]:
        """Flags this family needs beyond the Pretrainer's own (reported with them)."""
        return []

    @abstractmethod
    def build_model(self, config: RapidformerConfig, vocab_size: int, device: str) -> nn.Module:
        """The model the flags describe, initialised from ``--seed`` (left uninitialised on the
        meta device for ``device="meta"``: the engine initialises it once parallelised). The
        Pretrainer logs its ``config`` attribute, so the model needs one."""

    @abstractmethod
    def dataset(self, split: CorpusSplit, tokenizer: RapidTokenizer) -> Dataset:
        """The samples of ``split``."""

    @abstractmethod
    def collate(self, tokenizer: RapidTokenizer, seq_length: int | None) -> Callable[..., Any]:
        """Samples -> a batch padded to ``seq_length``; one that also takes a ``pad_to``
        keyword lets the dynamic-shape iterator pad to a bucket instead."""

    @abstractmethod
    def inputs(self, batch: Any) -> ModelInputs:
        """The model's inputs from a batch (the first pipeline stage's)."""

    def loss_inputs(self, batch: Any) -> ModelInputs:
        """The inputs plus the labels, for a model that computes its own LM loss in its
        forward (``--fused-lm-loss``); :meth:`loss` then receives that loss in the outputs."""
        raise NotImplementedError(f"the {self.name} family has no fused LM loss")

    @abstractmethod
    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The batch's mean loss from the model's outputs (the last pipeline stage's)."""

    @abstractmethod
    def weight(self, batch: Any) -> int | torch.Tensor:
        """The units :meth:`loss` averages over, so accumulation over micro-batches is exact."""

    def example_batch(self, micro_batch: int, seq_length: int, device: str) -> dict[str, Any]:
        """A batch of ``micro_batch`` samples of ``seq_length`` tokens as the collate function
        makes them, its values empty (the dry run passes one through the model on the meta
        device to count its activations)."""
        raise NotImplementedError(
            f"the {self.name} family has no example_batch(), which --dry-run needs"
        )

    def statistics(self, outputs: Any, batch: Any) -> dict[str, Any]:
        """Sums and counts :meth:`metrics` needs from one evaluated batch (none by default)."""
        return {}

    def metrics(
        self, outputs: list[Mapping[str, Any]], device: torch.device | None, group: Group
    ) -> dict[str, float]:
        """Metrics from this rank's eval outputs summed over the data-parallel ``group``.
        Every rank calls it, also one without validation batches (collectives must match)."""
        return {}

    def export(self, model: nn.Module, out_dir: str | Path, tokenizer: RapidTokenizer) -> Path:
        """Write ``model`` and ``tokenizer`` as a Hugging Face directory
        (``python -m rapidformer.export``). The built-in families convert to GPT-2 / BERT; a
        family whose model has no Hugging Face counterpart overrides this or refuses."""
        from rapidformer.models.convert import export_hugging_face

        return export_hugging_face(model, str(out_dir), tokenizer=tokenizer.to_hf())  # type: ignore[arg-type]
