"""GPT pretraining: next-token prediction over fixed-length windows of the token stream.

Selected by ``--tokenizer-type GPT2BPETokenizer``. Every sample is ``--seq-length`` tokens cut
from the concatenated documents, so batches need no padding, and the loss is the mean
cross-entropy over every token of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, default_collate

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.gpt_dataset import GPTDataset
from rapidformer.data.tokenizers import RapidTokenizer
from rapidformer.errors import Violation
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import ModelInputs
from rapidformer.templates.families.base import CorpusSplit, PretrainFamily, model_shape


class GPTFamily(PretrainFamily):
    """The built-in :class:`~rapidformer.models.gpt.GPTModel`, trained on next-token loss."""

    name = "gpt"
    tokenizer_types = ("GPT2BPETokenizer",)

    def config_violations(self, config: RapidformerConfig) -> list[Violation]:
        if config.data.merge_file is not None:
            return []
        return [
            Violation(
                "--merge-file",
                None,
                "the GPT-2 BPE tokenizer needs its merges file",
                "pass --merge-file merges.txt",
            )
        ]

    def build_model(self, config: RapidformerConfig, vocab_size: int, device: str) -> nn.Module:
        shape = GPTConfig(**model_shape(config, vocab_size))
        return GPTModel.build(shape, device=device, seed=config.training.seed)

    def dataset(self, split: CorpusSplit, tokenizer: RapidTokenizer) -> Dataset:
        return GPTDataset(*split.args())

    def collate(self, tokenizer: RapidTokenizer, seq_length: int | None) -> Callable[..., Any]:
        return default_collate  # every GPT sample has --seq-length tokens

    def inputs(self, batch: Any) -> ModelInputs:
        return (batch["input_ids"],)

    def loss_inputs(self, batch: Any) -> ModelInputs:
        return (batch["input_ids"], None, batch["labels"])

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        if outputs.ndim == 0:  # --fused-lm-loss: the model computed it from its labels
            return outputs
        return F.cross_entropy(outputs.float().flatten(0, 1), batch["labels"].flatten())

    def example_batch(self, micro_batch: int, seq_length: int, device: str) -> dict[str, Any]:
        tokens = torch.zeros(micro_batch, seq_length, dtype=torch.long, device=device)
        return {"input_ids": tokens, "labels": tokens.clone()}

    def weight(self, batch: Any) -> int | torch.Tensor:
        """Every predicted token."""
        return int(batch["labels"].numel())
