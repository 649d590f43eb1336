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
from rapidformer.data.documents import DOCUMENT_INPUTS
from rapidformer.data.gpt_dataset import GPTDataset
from rapidformer.data.tokenizers import RapidTokenizer
from rapidformer.errors import Violation
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import ModelInputs
from rapidformer.templates.families.base import CorpusSplit, PretrainFamily, model_shape

DOCUMENT_FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def document_violations(config: RapidformerConfig, family: str = "gpt") -> list[Violation]:
    """The document flags are the built-in GPT's, without sequence parallelism (the
    positions and the mask cover the whole sequence; pipeline stages pass the mask on)."""
    given = [f"--{name.replace('_', '-')}" for name in DOCUMENT_FLAGS
             if getattr(config.data, name)]  # fmt: skip
    if not given:
        return []
    parallel = config.parallel
    problem, fix = "", "drop it"
    if family != "gpt":
        problem = f"applies to the built-in GPT's pretraining (this run: {family})"
    elif parallel.sequence_parallel:
        problem = "cannot run with --sequence-parallel: the mask covers the whole sequence"
        fix = "drop it, or --sequence-parallel"
    if not problem:
        return []
    return [Violation(flag, True, problem, fix) for flag in given]


class GPTFamily(PretrainFamily):
    """The built-in :class:`~rapidformer.models.gpt.GPTModel`, trained on next-token loss."""

    name = "gpt"
    tokenizer_types = ("GPT2BPETokenizer",)

    def config_violations(self, config: RapidformerConfig) -> list[Violation]:
        violations = document_violations(config)
        if config.data.merge_file is not None:
            return violations
        return [
            *violations,
            Violation(
                "--merge-file",
                None,
                "the GPT-2 BPE tokenizer needs its merges file",
                "pass --merge-file merges.txt",
            ),
        ]

    def build_model(self, config: RapidformerConfig, vocab_size: int, device: str) -> nn.Module:
        shape = GPTConfig(**model_shape(config, vocab_size))
        return GPTModel.build(shape, device=device, seed=config.training.seed)

    def dataset(self, split: CorpusSplit, tokenizer: RapidTokenizer) -> Dataset:
        return GPTDataset(split)

    def collate(self, tokenizer: RapidTokenizer, seq_length: int | None) -> Callable[..., Any]:
        return default_collate  # every GPT sample has --seq-length tokens

    def inputs(self, batch: Any) -> ModelInputs:
        if "documents" in batch:  # --reset-position-ids / --reset-attention-mask
            return {key: batch[key] for key in DOCUMENT_INPUTS if key in batch}
        return (batch["input_ids"],)

    def loss_inputs(self, batch: Any) -> ModelInputs:
        if "documents" in batch:
            return {**self.inputs(batch), "labels": batch["labels"]}  # type: ignore[dict-item]
        return (batch["input_ids"], None, batch["labels"])

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        if outputs.ndim == 0:  # --fused-lm-loss: the model computed it from its labels
            return outputs
        return F.cross_entropy(outputs.float().flatten(0, 1), batch["labels"].flatten())

    def example_batch(self, micro_batch: int, seq_length: int, device: str) -> dict[str, Any]:
        tokens = torch.zeros(micro_batch, seq_length, dtype=torch.long, device=device)
        return {"input_ids": tokens, "labels": tokens.clone()}

    def weight(self, batch: Any) -> int | torch.Tensor:
        """Every predicted token (with --eod-mask-loss, every one not ignored)."""
        if "documents" in batch:
            return (batch["labels"] != IGNORE_INDEX).sum()
        return int(batch["labels"].numel())
