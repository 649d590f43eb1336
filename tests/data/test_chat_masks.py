"""The assistant mask found by rendering prefixes turn by turn equals, token for token, the mask
transformers gives for the same template with ``{% generation %}`` tags, for templates written
here in the formats of ChatML, Llama 3, Mistral, Gemma and Qwen (multi-turn, a system prompt, a
tool call); a template that re-renders earlier turns is read through its tags, or refused."""

from __future__ import annotations

from typing import Any

import pytest

from rapidformer.data.chat import Sample, samples
from rapidformer.data.chat_masks import ChatRenderer, covered
from rapidformer.data.named_templates import template_names, template_path
from rapidformer.errors import DataError
from rapidformer.testing.families import tiny_model

GENERATION, END = "{% generation %}", "{% endgeneration %}"

TEMPLATES = {name: template_path(name).read_text() for name in template_names()}  # type: ignore[union-attr]
"""The templates rapidformer ships, tagged; the same without their tags is what rendering
prefixes reads."""

THINKING = (
    "{%- set last = namespace(user=0) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- set content = m.content if loop.index0 > last.user "
    "else m.content.split('</think>')[-1] -%}"
    "{% generation %}{{- content + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Qwen3's way with past reasoning: an assistant turn before the last user turn loses its
``<think>`` part, so a prefix renders otherwise than the start of the whole."""

SPECIALS = [
    "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "<start_of_turn>", "<end_of_turn>", "<tool_call>", "</tool_call>",
]  # fmt: skip
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "multi-turn with a system prompt": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Where does the cat sit?"},
        {"role": "assistant", "content": "The cat sits on the mat."},
        {"role": "user", "content": "And the dog?"},
        {"role": "assistant", "content": "The dog runs in the park."},
    ],
    "a tool call": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 21 degrees"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ],
}


def _untagged(template: str) -> str:
    return template.replace(GENERATION, "").replace(END, "")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = tiny_model("llama", tmp_path_factory.mktemp("chat") / "llama")
    loaded = AutoTokenizer.from_pretrained(path)
    loaded.add_special_tokens({"additional_special_tokens": SPECIALS})
    return loaded


def _renderer(tokenizer: Any, template: str) -> ChatRenderer:
    return ChatRenderer(tokenizer, 4096, template, "the test's template")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", TEMPLATES)
def test_the_prefix_mask_equals_the_generation_tags_mask(
    tokenizer: Any, family: str, conversation: str
) -> None:
    turns = CONVERSATIONS[conversation]
    rendered = _renderer(tokenizer, _untagged(TEMPLATES[family])).render(
        Sample(turns=turns), 0, "train"
    )
    tagged = tokenizer.apply_chat_template(
        turns, chat_template=TEMPLATES[family], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert rendered.input_ids == tagged["input_ids"]
    assert rendered.supervised == [bool(on) for on in tagged["assistant_masks"]]
    assert 0 < sum(rendered.supervised) < len(rendered.supervised)


def test_a_template_that_re_renders_past_turns_is_read_by_its_tags_or_refused(
    tokenizer: Any,
) -> None:
    turns = [
        {"role": "user", "content": "Two and two?"},
        {"role": "assistant", "content": "<think>add them</think>Four."},
        {"role": "user", "content": "And three more?"},
        {"role": "assistant", "content": "<think>four and three</think>Seven."},
    ]
    tagged = tokenizer.apply_chat_template(
        turns, chat_template=THINKING, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    rendered = _renderer(tokenizer, THINKING).render(Sample(turns=turns), 0, "train")
    assert rendered.supervised == [bool(on) for on in tagged["assistant_masks"]]
    with pytest.raises(DataError, match=r"renders the earlier turns .* no \{% generation %\}"):
        _renderer(tokenizer, _untagged(THINKING)).render(Sample(turns=turns), 3, "train")


def test_an_instruction_learns_its_completion_and_the_end_of_sequence(tokenizer: Any) -> None:
    prompt, completion = "Translate: the cat sits.", " Le chat est assis."
    rendered = _renderer(tokenizer, "").render(
        Sample(prompt=prompt, completion=completion), 0, "train"
    )
    learned = [t for t, on in zip(rendered.input_ids, rendered.supervised, strict=True) if on]
    assert tokenizer.decode(learned) == completion + tokenizer.eos_token
    whole = ChatRenderer(tokenizer, 4096, "", train_on_inputs=True).render(
        Sample(prompt=prompt, completion=completion), 0, "train"
    )
    assert all(whole.supervised) and whole.input_ids == rendered.input_ids


def test_truncation_cuts_tokens_and_their_marks_alike(tokenizer: Any) -> None:
    turns = CONVERSATIONS["multi-turn with a system prompt"]
    template = _untagged(TEMPLATES["chatml"])
    whole = _renderer(tokenizer, template).render(Sample(turns=turns), 0, "train")
    cut = ChatRenderer(tokenizer, 12, template).render(Sample(turns=turns), 0, "train")
    assert cut.truncated and not whole.truncated
    assert cut.input_ids == whole.input_ids[:12] and cut.supervised == whole.supervised[:12]


def test_a_span_covers_every_token_it_overlaps() -> None:
    offsets = [(0, 0), (0, 3), (3, 5), (5, 9), (9, 10)]
    assert covered(offsets, [(4, 9)]) == [2, 3]
    assert covered(offsets, [(0, 1), (9, 10)]) == [1, 4]  # the BOS (0, 0) never


def test_conversations_without_a_template_are_refused_with_the_fix(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer, 64)  # the tiny model's tokenizer has no template
    with pytest.raises(DataError, match="--chat-template FILE"):
        renderer.render(Sample(turns=CONVERSATIONS["a tool call"]), 0, "train")


def test_tool_definitions_reach_the_template(tokenizer: Any) -> None:
    """A ``tools`` column is rendered by the template (here into the system turn); the mask
    still equals the tagged one."""
    template = (
        "{%- if tools -%}{{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' -}}"
        "{%- endif -%}" + TEMPLATES["chatml"]
    )
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    turns = CONVERSATIONS["a tool call"]
    rendered = _renderer(tokenizer, _untagged(template)).render(
        Sample(turns=turns, tools=tools), 0, "train"
    )
    tagged = tokenizer.apply_chat_template(
        turns, chat_template=template, tools=tools, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert rendered.input_ids == tagged["input_ids"]
    assert "weather" in tokenizer.decode(rendered.input_ids)
    assert rendered.supervised == [bool(on) for on in tagged["assistant_masks"]]


def test_a_prompt_and_completion_of_turns_learn_the_completion_alone(tokenizer: Any) -> None:
    """The same turns as a conversation and as a prompt (with an earlier assistant turn) and
    a completion: the same tokens; the conversation learns both assistant turns (as the tags
    mark them), the pair only its completion."""
    from datasets import Dataset

    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Cat?"},
    ]
    completion = [{"role": "assistant", "content": "On the mat."}]
    pair = samples(Dataset.from_dict({"prompt": [prompt], "completion": [completion]}), "train")
    template = TEMPLATES["chatml"]
    as_pair = _renderer(tokenizer, _untagged(template)).render(pair[0], 0, "train")
    as_chat = _renderer(tokenizer, _untagged(template)).render(
        Sample(turns=prompt + completion), 0, "train"
    )
    tagged = tokenizer.apply_chat_template(
        prompt + completion, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert as_pair.input_ids == as_chat.input_ids == tagged["input_ids"]
    assert as_chat.supervised == [bool(on) for on in tagged["assistant_masks"]]
    learned = [t for t, on in zip(as_pair.input_ids, as_pair.supervised, strict=True) if on]
    assert tokenizer.decode(learned) == "On the mat.<|im_end|>\n"
    pairs = zip(as_pair.supervised, as_chat.supervised, strict=True)
    assert all(chat or not only for only, chat in pairs)


def test_samples_cut_to_nothing_are_refused_or_dropped_and_counted(tokenizer: Any) -> None:
    """Cut to 32 tokens, the conversation with a long question keeps no assistant token: the
    split is refused, naming it and the fix; with --drop-unsupervised it is left out and the
    log counts it, and the cuts."""
    from datasets import Dataset

    from rapidformer.templates.tasks.supervised import ChatOptions, supervised_features

    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]

    long_question = "Is " + "the cat " * 30
    rows = Dataset.from_dict({"messages": [chat("Cat?"), chat(long_question), chat("Mat?")]})
    template = _untagged(TEMPLATES["chatml"])
    with pytest.raises(DataError, match=r"1 of the train split's 3 samples .*\(rows 1\).*--drop"):
        supervised_features(rows, "train", tokenizer, 32, ChatOptions(chat_template=template))
    options = ChatOptions(chat_template=template, drop_unsupervised=True)
    features = supervised_features(rows, "train", tokenizer, 32, options)
    assert len(features) == 2
    kept = [_renderer(tokenizer, template).render(Sample(turns=chat(q)), 0, "train").input_ids
            for q in ("Cat?", "Mat?")]  # fmt: skip
    assert [row["input_ids"] for row in features.rows] == kept
    (note,) = features.extra["notes"]
    assert "; 1 cut to --seq-length 32; 1 dropped with nothing left to learn" in note


def test_a_long_conversation_renders_in_linear_time_and_masks_as_its_cut_start(
    tokenizer: Any,
) -> None:
    """4,000 turns render within 5 s: only the turns that start within --seq-length tokens are
    rendered as prefixes (the rest is cut away), and the marks are those of the conversation's
    start rendered alone."""
    import time

    turns = [
        {"role": role, "content": f"turn {i} says a few words"}
        for i, role in zip(range(4000), ["user", "assistant"] * 2000, strict=True)
    ]
    template = TEMPLATES["chatml"].replace(GENERATION, "").replace(END, "")
    renderer = ChatRenderer(tokenizer, 256, template, "the test's template")
    started = time.perf_counter()
    long = renderer.render(Sample(turns=turns), 0, "train")
    elapsed = time.perf_counter() - started
    short = renderer.render(Sample(turns=turns[:60]), 0, "train")  # past 256 tokens too
    assert long.truncated and short.truncated
    assert (long.input_ids, long.supervised) == (short.input_ids, short.supervised)
    assert any(long.supervised) and elapsed < 5.0, elapsed
