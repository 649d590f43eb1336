"""Document boundaries inside GPT pretraining samples (Megatron's ``--reset-position-ids``,
``--reset-attention-mask`` and ``--eod-mask-loss``).

A GPT sample is ``--seq-length`` tokens cut from the concatenated documents, so it may hold the
end of one document, an end-of-document token (EOD), and the start of the next. The EOD ends
its document; the token after it starts the next. From the token ids alone, on the host, in the
collate function:

* ``position_ids``: restarting at 0 at each document's first token;
* ``document_mask`` ``[B, 1, T, T]``, boolean: a token may attend to the earlier tokens of its
  own document only;
* labels ignored (-100) where the input is an EOD: the next document's first token is not
  predicted from the previous one's end.

Each flag adds its part alone; ``documents`` (the document index of each token) marks the batch
as one whose loss counts only the labels that are not ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from rapidformer.labels import IGNORE_INDEX

DOCUMENT_INPUTS = ("input_ids", "position_ids", "document_mask")
"""What the built-in GPT is given from a batch with document parts (those it has)."""


def document_collate(
    data: Any, eod: int, collate: Callable[..., Any] = default_collate
) -> DocumentCollate | None:
    """The collate function of ``data``'s document flags (a DataConfig), None if none is set."""
    if not (data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss):
        return None
    return DocumentCollate(
        eod,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        collate=collate,
    )


class DocumentCollate:
    """``default_collate``, then the parts the flags ask for (see the module docstring)."""

    def __init__(
        self,
        eod: int,
        *,
        reset_position_ids: bool,
        reset_attention_mask: bool,
        eod_mask_loss: bool,
        collate: Callable[..., Any] = default_collate,
    ) -> None:
        self.eod = eod
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.collate = collate

    def __call__(self, samples: Sequence[Any]) -> dict[str, torch.Tensor]:
        return self.add_parts(dict(self.collate(samples)))

    def add_parts(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` (``input_ids`` and ``labels``) with the parts the flags ask for, made
        where its tensors are (the dry run's are on the meta device)."""
        tokens = batch["input_ids"]
        is_eod = tokens == self.eod
        documents = torch.cumsum(is_eod, dim=1) - is_eod.long()  # an EOD ends its document
        batch["documents"] = documents
        if self.reset_position_ids:
            index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            starts = torch.ones_like(is_eod)
            starts[:, 1:] = is_eod[:, :-1]
            first = torch.cummax(torch.where(starts, index, 0), dim=1).values
            batch["position_ids"] = index - first
        if self.reset_attention_mask:
            length = tokens.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
            same = documents[:, :, None] == documents[:, None, :]
            batch["document_mask"] = (same & causal)[:, None]
        if self.eod_mask_loss:
            batch["labels"] = batch["labels"].masked_fill(is_eod, IGNORE_INDEX)
        return batch
