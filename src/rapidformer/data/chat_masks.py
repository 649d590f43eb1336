"""Render chat and instruction samples with the tokenizer's chat template, and mark the tokens
the loss is taken on.

What the model learns: in a conversation, the assistant turns (in prompt-completion data, the
completion); in a string prompt and completion, the completion and the end-of-sequence token.
``--train-on-inputs`` takes the loss on every token instead.

Where an assistant turn is, in tokens, comes from rendering the conversation's prefixes turn by
turn (as Megatron-Bridge does): the turn is what rendering the conversation up to it adds to the
conversation before it with the generation prompt. So templates need no ``{% generation %}``
tags, and a stock template never trains on nothing or on everything without a word. This holds
only where each prefix renders as the start of the whole; a template that renders earlier turns
differently (some drop an assistant's past reasoning) breaks it: its tags are used if it has
them, and otherwise it is refused, named.

Characters become tokens as transformers does for tagged templates: a span covers every token
that overlaps it. Nothing is inferred on the device: labels are built here, once per sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rapidformer.data.chat import Sample
from rapidformer.errors import DataError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""The opening tag transformers reads the assistant's spans from."""


@dataclass(frozen=True)
class Rendered:
    """One sample's tokens and whether the loss is taken on each, cut to the sequence
    length (``truncated``: it was longer)."""

    input_ids: list[int]
    supervised: list[bool]
    truncated: bool


class ChatRenderer:
    """Renders one split's samples with one template (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        seq_length: int,
        template: str | None = None,
        template_name: str = "",
        train_on_inputs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.template = template if template is not None else _default_template(tokenizer)
        self.template_name = template_name or (
            f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
        )
        self.train_on_inputs = train_on_inputs
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                f"{type(tokenizer).__name__} is not a fast tokenizer: chat data needs its "
                "character offsets to find the assistant's tokens. Fix: save the model with a "
                "fast (tokenizers) tokenizer"
            )

    def render(self, sample: Sample, row: int, split: str) -> Rendered:
        marked: list[int] | None = None
        if sample.turns is None:
            assert sample.prompt is not None and sample.completion is not None
            text, spans = self._instruction(sample.prompt, sample.completion)
            encoded = self.tokenizer(text, return_offsets_mapping=True)
        else:
            if self.template is None:
                raise DataError(
                    f"the {split} split holds conversations and {self.template_name} does not "
                    "exist. Fix: pass --chat-template FILE (a Jinja template, as "
                    "tokenizer_config.json's chat_template)"
                )
            encoded, spans, marked = self._conversation(sample, row, split)
        ids: list[int] = encoded["input_ids"]
        supervised = [self.train_on_inputs] * len(ids)
        for index in marked if marked is not None else covered(encoded["offset_mapping"], spans):
            supervised[index] = True
        cut = self.seq_length
        return Rendered(ids[:cut], supervised[:cut], truncated=len(ids) > cut)

    def _instruction(self, prompt: str, completion: str) -> tuple[str, list[tuple[int, int]]]:
        eos = self.tokenizer.eos_token or ""
        text = prompt + completion
        # End with the end-of-sequence token, learned too: the model learns where to stop.
        text = text + eos if eos and not text.endswith(eos) else text
        return text, [(len(prompt), len(text))]

    def _conversation(
        self, sample: Sample, row: int, split: str
    ) -> tuple[Any, list[tuple[int, int]], list[int] | None]:
        """The rendered conversation tokenized, and the assistant's characters (or, read from
        the template's tags, directly its tokens). Only the turns that start within
        --seq-length tokens are rendered as prefixes: a later one is cut away, and rendering
        every prefix of a long conversation would cost the square of its turns."""
        assert sample.turns is not None
        turns = sample.turns
        whole = self._render(turns, row, split, tools=sample.tools)
        # The template writes the special tokens (a BOS among them) itself.
        encoded = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        cut = offsets[self.seq_length][0] if len(offsets) > self.seq_length else len(whole)
        spans = []
        for index in range(sample.supervised_from, len(turns)):
            if turns[index]["role"] != "assistant":
                continue
            before = self._render(
                turns[:index], row, split, generation_prompt=True, tools=sample.tools
            )
            if len(before) >= cut and whole.startswith(before):
                break  # this turn, and every later one, starts past the cut
            through = self._render(turns[: index + 1], row, split, tools=sample.tools)
            if not (whole.startswith(through) and through.startswith(before)):
                return encoded, [], self._tagged_tokens(sample, whole, row, split)
            spans.append((len(before), len(through)))
        return encoded, spans, None

    def _tagged_tokens(self, sample: Sample, whole: str, row: int, split: str) -> list[int]:
        """The assistant's tokens as the template's ``{% generation %}`` tags mark them, for a
        template whose prefixes do not render as the start of the whole."""
        tagged = self.template is not None and GENERATION_TAG.search(self.template) is not None
        if not tagged or sample.supervised_from:
            raise DataError(
                f"{self.template_name} renders the earlier turns of the {split} split's row "
                f"{row} differently once later turns follow (as templates that drop past "
                "reasoning do), so the assistant's turns cannot be found by rendering prefixes"
                + (", and its {% generation %} tags mark every assistant turn, the prompt's too"
                   if tagged else ", and it has no {% generation %} tags")
                + ". Fix: pass --chat-template FILE with {% generation %}...{% endgeneration %} "
                "around each assistant turn (of a messages column), or --train-on-inputs"
            )  # fmt: skip
        marked = self.tokenizer.apply_chat_template(
            sample.turns, chat_template=self.template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, tools=sample.tools,
        )  # fmt: skip
        encoded = self.tokenizer(whole, add_special_tokens=False)
        if list(marked["input_ids"]) != list(encoded["input_ids"]):
            raise DataError(
                f"{self.template_name} tokenizes the {split} split's row {row} otherwise with "
                "its tags than without. Fix: --train-on-inputs, or a template whose prefixes "
                "render as the start of the whole"
            )
        return [i for i, on in enumerate(marked["assistant_masks"]) if on]

    def _render(
        self,
        turns: list[dict[str, Any]],
        row: int,
        split: str,
        generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tokenize=False,
                add_generation_prompt=generation_prompt, tools=tools,
            )  # fmt: skip
        except Exception as exc:
            raise DataError(
                f"{self.template_name} cannot render the {split} split's row {row}: {exc}"
            ) from exc
        return str(text)


def covered(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the tokens (character ``offsets``) that overlap any of ``spans``, as
    transformers marks tagged spans (a token with no characters counts where it stands inside
    a span; a BOS the tokenizer adds at (0, 0) overlaps nothing)."""
    return [
        index
        for index, (start, end) in enumerate(offsets)
        if any(start < stop and end > begin for begin, stop in spans)
    ]


def _default_template(tokenizer: Any) -> str | None:
    """The tokenizer's template (its default one where it has several, named); None if none."""
    try:
        return str(tokenizer.get_chat_template())
    except ValueError:  # transformers' "no chat template" error
        return None
