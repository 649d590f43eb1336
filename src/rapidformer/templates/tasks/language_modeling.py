"""The language-modelling tasks: masked, causal and sequence to sequence."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from rapidformer.data.packing import packed_mask
from rapidformer.errors import DataError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.templates.tasks.base import (
    Evaluated,
    Features,
    Recipe,
    Task,
    column,
    encoded_rows,
    pad_rows,
)
from rapidformer.templates.tasks.supervised import (
    ChatOptions,
    is_supervised_data,
    refuse_chat_flags_on_text,
    supervised_features,
)

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset
    from transformers import PreTrainedTokenizerBase


class LanguageModeling(Task):
    """Shared by the three LM tasks: token-weighted loss, perplexity, token accuracy."""

    sequence_keys: ClassVar[dict[str, int | None]] = {**Task.sequence_keys, "labels": IGNORE_INDEX}
    TEXT = ("text", "content", "sentence", "document")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        text = column(rows, self.TEXT, split, "text")
        encoded = self._encode(list(rows[text]))
        features = encoded_rows(encoded)
        return Features([f for f in features if len(f["input_ids"]) > 1], split)

    def loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if getattr(outputs, "logits", True) is None:  # --fused-lm-loss: computed in forward
            return outputs.loss
        logits, labels = self.predictions(outputs, batch)
        return F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )

    def weight(self, batch: Mapping[str, torch.Tensor]) -> int | torch.Tensor:
        return (self.targets(batch) != IGNORE_INDEX).sum()  # the loss is a mean over tokens

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The token each scored position predicts (IGNORE_INDEX elsewhere)."""
        return batch["labels"]

    def predictions(
        self, outputs: Any, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the targets they score, aligned."""
        return outputs.logits, self.targets(batch)

    def statistics(
        self, outputs: Any, batch: Mapping[str, torch.Tensor], loss: torch.Tensor
    ) -> dict[str, Any]:
        logits, labels = self.predictions(outputs, batch)
        scored = labels != IGNORE_INDEX
        tokens = scored.sum()
        return {
            "num_tokens": tokens,
            "loss_sum": loss.detach() * tokens,
            "correct": ((logits.float().argmax(-1) == labels) & scored).sum(),
        }

    def metrics(self, evaluated: Evaluated) -> dict[str, float]:
        loss_sum = evaluated.total("loss_sum")
        tokens = evaluated.total("num_tokens").clamp(min=1)
        correct = evaluated.total("correct")
        return {
            "perplexity": math.exp(min(float(loss_sum / tokens), 50.0)),
            "token_accuracy": float(correct / tokens),
        }


class MaskedLM(LanguageModeling):
    """Masked-LM: 15% of the non-special tokens are predicted (80% shown as the mask token,
    10% as a random token, 10% unchanged)."""

    name = "masked_lm"
    auto_class = "AutoModelForMaskedLM"
    recipe = Recipe(5e-5, 3, 0.0, "transformers' run_mlm.py")
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


class CausalLM(LanguageModeling):
    """Causal LM: each token predicts the next; padding is never a target. Chat and
    instruction data (a ``messages`` column, or ``prompt`` and ``completion``) are rendered
    with the chat template and learn only the assistant's tokens
    (:mod:`rapidformer.templates.tasks.supervised`)."""

    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    recipe = Recipe(5e-5, 3, 0.0, "transformers' run_clm.py")
    per_sample_attention = False
    """The model runs packed rows one sample at a time
    (:mod:`rapidformer.models.packed_attention`): it is given which sample each token is of."""
    position_offset = 0
    """Added to packed rows' positions (which restart at 0 in each sample) for a model that
    counts positions from elsewhere (:func:`rapidformer.models.packable.position_offset`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        seq_length: int,
        seed: int = 0,
        chat: ChatOptions | None = None,
    ) -> None:
        super().__init__(tokenizer, seq_length, seed)
        self.chat = chat or ChatOptions()

    def prepare(self, rows: HFDataset, split: str) -> Features:
        if is_supervised_data(rows):
            return supervised_features(rows, split, self.tokenizer, self.seq_length, self.chat)
        refuse_chat_flags_on_text(rows, split, self.chat)
        return super().prepare(rows, split)

    def _encode(self, texts: list[str], pairs: list[str] | None = None) -> dict[str, list[Any]]:
        eos = self.tokenizer.eos_token
        # End each text with the end-of-sequence token, so the model learns where texts stop.
        texts = [t + eos if eos and not t.endswith(eos) else t for t in texts]
        return super()._encode(texts)

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.token_labels(batch)[:, 1:]  # the shift: position t's logits score token t + 1

    def token_labels(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tokens learned (unshifted, as Hugging Face models take labels): chat data's
        labels, else every token but padding."""
        if "labels" in batch:
            return batch["labels"]
        return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)

    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "packed_samples" in batch:  # --packing: each sample attends to itself only
            positions = batch["position_ids"]
            if self.position_offset:  # a RoBERTa's (else no extra tensor each step)
                positions = positions + self.position_offset
            inputs = {
                "input_ids": batch["input_ids"],
                "attention_mask": packed_mask(batch["packed_samples"]),
                "position_ids": positions,
            }
            if self.per_sample_attention:
                inputs["packed_samples"] = batch["packed_samples"]
            return inputs
        return super().inputs(batch)

    def loss_inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs plus the labels, for a model patched to compute its loss in its forward
        (``--fused-lm-loss``: :mod:`rapidformer.models.hf_fused_loss`)."""
        return {**self.inputs(batch), "labels": self.token_labels(batch)}

    def predictions(
        self, outputs: Any, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.logits[:, :-1], self.targets(batch)


class Seq2SeqLM(LanguageModeling):
    """Sequence to sequence: the encoder reads the source, the decoder predicts the target."""

    name = "seq2seq_lm"
    auto_class = "AutoModelForSeq2SeqLM"
    recipe = Recipe(5e-5, 3, 0.0, "transformers' run_summarization.py")
    SOURCE = ("source", "input", "document", "text", "src")
    TARGET = ("target", "output", "summary", "label", "tgt")

    def prepare(self, rows: HFDataset, split: str) -> Features:
        source = column(rows, self.SOURCE, split, "source")
        target = column(rows, self.TARGET, split, "target")
        encoded = self._encode(list(rows[source]))
        targets = self.tokenizer(
            text_target=list(rows[target]), truncation=True, max_length=self.seq_length
        )["input_ids"]
        features = [{**row, "target": targets[i]} for i, row in enumerate(encoded_rows(encoded))]
        return Features(features, split)

    def collate(self, samples: list[Mapping[str, Any]], pad_to: int | None = None) -> Any:
        batch = super().collate(samples, pad_to)
        targets = [s["target"] for s in samples]
        longest = max(len(t) for t in targets)
        # Targets: the fixed length, or (dynamic shape) their longest rounded up to 8 tokens.
        length = -(-longest // 8) * 8 if pad_to else self.seq_length
        batch["labels"] = pad_rows(targets, length, IGNORE_INDEX)
        return batch

    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The labels go in too: the model shifts them right to build the decoder's inputs.
        return {**super().inputs(batch), "labels": batch["labels"]}
