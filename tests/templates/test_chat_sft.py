"""Supervised fine-tuning on chat data, against a reference built from transformers' own
assistant mask (a ``{% generation %}``-tagged template): the causal LM's loss on a batch is the
mean cross-entropy of exactly the assistant's tokens, and a black-box run learns them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rapidformer.cli import main
from rapidformer.templates.tasks import CausalLM
from rapidformer.templates.tasks.supervised import ChatOptions
from rapidformer.testing.families import tiny_model
from tests.helpers.trainers import read_losses

TAGGED = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- m.content + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TEMPLATE = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
ANIMALS = ["cat", "dog", "bird", "fox", "cow"]
PLACES = ["on the mat", "in the park", "under the tree", "by the river"]


def _conversation(rng: random.Random) -> dict[str, Any]:
    turns: list[dict[str, str]] = [{"role": "system", "content": "Answer in one sentence."}]
    for _ in range(rng.randint(1, 3)):
        animal = rng.choice(ANIMALS)
        turns.append({"role": "user", "content": f"where is the {animal}"})
        turns.append({"role": "assistant", "content": f"the {animal} is {rng.choice(PLACES)}"})
    return {"messages": turns}


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny Llama whose tokenizer knows ChatML's markers, a template file, and chat data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("sft")
    base = tiny_model("llama", root / "base", max_positions=256)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    (root / "chatml.jinja").write_text(TEMPLATE)
    rng = random.Random(0)
    (root / "data").mkdir()
    for split, count in (("train", 48), ("validation", 8)):
        lines = [json.dumps(_conversation(rng)) for _ in range(count)]
        (root / "data" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root / "llama", root / "chatml.jinja", root / "data"


SEQ = 192
"""Longer than any conversation here: no sample is cut."""


def _reference(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[float, int]:
    """Mean cross-entropy over the tokens transformers' tagged mask marks, and their count."""
    total, count = 0.0, 0
    for row in rows:
        marked = tokenizer.apply_chat_template(
            row["messages"], chat_template=TAGGED, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        assert len(marked["input_ids"]) <= SEQ
        ids = torch.tensor([marked["input_ids"]])
        learned = torch.tensor(marked["assistant_masks"][1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        losses = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        total += float(losses[learned].sum())
        count += int(learned.sum())
    return total / count, count


def test_the_loss_is_the_mean_over_exactly_the_assistant_tokens(
    chat: tuple[Path, Path, Path],
) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, template, data = chat
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()][:6]
    task = CausalLM(tokenizer, SEQ, chat=ChatOptions(chat_template=template.read_text()))
    features = task.prepare(Dataset.from_list(rows), "train")
    batch = task.collate(features.rows)  # right-padded to SEQ tokens
    with torch.no_grad():
        loss = task.loss(model(**task.inputs(batch)), batch)
    expected, count = _reference(model, tokenizer, rows)
    assert int(task.weight(batch)) == count
    assert abs(float(loss) - expected) <= 1e-5


def test_a_black_box_run_learns_the_assistant_turns_in_full_and_with_adapters(
    chat: tuple[Path, Path, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, template, data = chat
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--chat-template", str(template), "--seq-length", str(SEQ)),
        *("--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2"),
        *("--train-iters", "12", "--log-interval", "1", "--eval-interval", "12"),
    ]
    assert main([*flags, "--save", str(tmp_path / "run")]) == 0
    said = capfd.readouterr().err
    losses = read_losses(tmp_path / "run")
    assert losses[12] < 0.7 * losses[1]
    # Adapters on the same chat data: the base's first loss (B = 0), then they learn.
    assert main([*flags, "--lora-rank", "8", "--save", str(tmp_path / "lora")]) == 0
    adapted = read_losses(tmp_path / "lora")
    assert adapted[1] == losses[1] and adapted[12] < 0.97 * adapted[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    _, learned = _reference(model, tokenizer, rows)
    assert f"train: 48 messages samples, {learned:,} tokens learned" in said


def _eval_loss(save: Path) -> float:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval_loss"] for r in records if r["kind"] == "eval")


def test_packing_scores_the_same_tokens_as_padding(
    chat: tuple[Path, Path, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Evaluated after a step too small to move the weights, a packed run's validation loss is
    the padded run's (the same tokens, each sample attending only to itself)."""
    model_dir, template, data = chat
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--chat-template", str(template), "--seq-length", str(SEQ)),
        *("--micro-batch-size", "2", "--lr", "1e-12", "--train-iters", "1"),
        *("--eval-interval", "1", "--lr-warmup-fraction", "0"),
    ]
    assert main([*flags, "--save", str(tmp_path / "padded")]) == 0
    assert main([*flags, "--packing", "--save", str(tmp_path / "packed")]) == 0
    said = capfd.readouterr().err
    assert "train: 48 samples packed into" in said and "validation: 8 samples packed" in said
    assert abs(_eval_loss(tmp_path / "packed") - _eval_loss(tmp_path / "padded")) <= 1e-5
