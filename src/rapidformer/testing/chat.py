"""A tiny chat model and chat data it can learn, made offline, for tests, demos and notebooks.

:func:`tiny_chat_model` saves a tiny Llama whose tokenizer knows ChatML's turn markers as
special tokens and ships a ChatML chat template (``tokenizer.chat_template``), as an instruct
model's directory does. :func:`chat_dataset` writes ``train.jsonl`` and ``validation.jsonl``
in the ``messages`` format: a system prompt, then one to three questions "where is the ANIMAL"
each answered "the ANIMAL is PLACE", the place fixed per animal, so that a tiny model can
learn the answers (the questions and the system prompt are never learned).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rapidformer.testing.families import tiny_model

CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, as rapidformer writes it (no generation tags: none are needed)."""
MARKERS = ["<|im_start|>", "<|im_end|>"]
WHERE = {
    "cat": "on the mat",
    "dog": "in the park",
    "bird": "in the tree",
    "fox": "by the river",
    "cow": "in the field",
}
"""Each animal's place: the answers are learnable."""


def tiny_chat_model(out_dir: str | Path, max_positions: int = 256) -> Path:
    """Save a tiny Llama with ChatML markers and template to ``out_dir``; returns it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    base = tiny_model("llama", out / "base", max_positions=max_positions)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def conversation(rng: random.Random) -> dict[str, Any]:
    turns: list[dict[str, str]] = [{"role": "system", "content": "Answer in one sentence."}]
    for _ in range(rng.randint(1, 3)):
        animal = rng.choice(sorted(WHERE))
        turns.append({"role": "user", "content": f"where is the {animal}"})
        turns.append({"role": "assistant", "content": f"the {animal} is {WHERE[animal]}"})
    return {"messages": turns}


def chat_dataset(out_dir: str | Path, train: int = 64, validation: int = 16, seed: int = 0) -> Path:
    """Write ``train`` and ``validation`` conversations (see the module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in (("train", train), ("validation", validation)):
        lines = [json.dumps(conversation(rng)) for _ in range(count)]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out
