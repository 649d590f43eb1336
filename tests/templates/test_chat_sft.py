"""Supervised fine-tuning on chat data, against a reference built from transformers' own
assistant mask (a ``{% generation %}``-tagged template): the causal LM's loss on a batch is the
mean cross-entropy of exactly the assistant's tokens, and a black-box run learns them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rapidformer.cli import main
from rapidformer.templates.tasks import CausalLM
from rapidformer.templates.tasks.supervised import ChatOptions
from rapidformer.testing.chat import CHATML, chat_dataset, tiny_chat_model
from tests.helpers.trainers import launched, read_losses

TAGGED = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- m.content + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""The shipped ChatML template, its assistant turns tagged: transformers' mask is the reference."""


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny Llama with ChatML's markers and template, that template as a file, chat data."""
    root = tmp_path_factory.mktemp("sft")
    (root / "chatml.jinja").write_text(CHATML)
    data = chat_dataset(root / "data", train=48, validation=8)
    return tiny_chat_model(root / "llama"), root / "chatml.jinja", data


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
    saved = AutoTokenizer.from_pretrained(tmp_path / "run")  # renders as training did
    assert saved.chat_template == template.read_text()
    # Adapters on the same chat data: the base's first loss (B = 0), then they learn.
    assert main([*flags, "--lora-rank", "8", "--save", str(tmp_path / "lora")]) == 0
    adapted = read_losses(tmp_path / "lora")
    assert adapted[1] == losses[1] and adapted[12] < 0.97 * adapted[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    _, learned = _reference(model, tokenizer, rows)
    assert f"train: 48 messages samples, {learned:,} tokens learned" in said


def _eval_record(save: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["kind"] == "eval")


def _eval_loss(save: Path) -> float:
    return float(_eval_record(save)["eval_loss"])


def test_packing_scores_the_same_tokens_as_padding(
    chat: tuple[Path, Path, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Evaluated after a step too small to move the weights, a packed run's validation loss,
    perplexity and token accuracy are the padded run's (the same tokens, each sample attending
    only to itself; the accuracy within one token of the split's in a thousand, as an argmax
    may flip at a tie within rounding). The model's own chat template renders the data here
    (no --chat-template)."""
    model_dir, _, data = chat
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--seq-length", str(SEQ)),
        *("--micro-batch-size", "2", "--lr", "1e-12", "--train-iters", "1"),
        *("--eval-interval", "1", "--lr-warmup-fraction", "0"),
    ]
    assert main([*flags, "--save", str(tmp_path / "padded")]) == 0
    said = capfd.readouterr().err
    assert f"data: {data}: train 48 samples, validation 8 samples" in said  # no "(-)"
    assert "fixed shape (as the collate function pads)" in said
    assert main([*flags, "--packing", "--save", str(tmp_path / "packed")]) == 0
    said = capfd.readouterr().err
    assert "train: 48 samples packed into" in said and "validation: 8 samples packed" in said
    assert "packed rows, validation" in said  # the data line counts rows, not samples
    assert f"fixed shape: packed rows of {SEQ} tokens" in said
    assert abs(_eval_loss(tmp_path / "packed") - _eval_loss(tmp_path / "padded")) <= 1e-5
    packed, padded = (_eval_record(tmp_path / name) for name in ("packed", "padded"))
    assert abs(packed["perplexity"] / padded["perplexity"] - 1) <= 1e-5
    assert abs(packed["token_accuracy"] - padded["token_accuracy"]) <= 1e-3


def test_a_packed_roberta_is_given_its_own_positions(tmp_path: Path) -> None:
    """RoBERTa loaded for the causal LM counts positions from its padding id + 1: a packed
    run gives them so (the Finetuner reads where from the model), and its validation loss is
    the padded run's (the control in tests/data/test_packing.py shows what positions from 0
    would cost)."""
    from rapidformer.testing.families import tiny_model
    from rapidformer.testing.finetune import task_dataset

    model_dir = tiny_model("roberta", tmp_path / "roberta", max_positions=64)
    data = task_dataset("causal_lm", tmp_path / "text", train=24, validation=8)
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--seq-length", "64"),
        *("--micro-batch-size", "2", "--lr", "1e-12", "--train-iters", "1"),
        *("--eval-interval", "1", "--lr-warmup-fraction", "0"),
    ]
    assert main([*flags, "--save", str(tmp_path / "padded")]) == 0
    assert main([*flags, "--packing", "--save", str(tmp_path / "packed")]) == 0
    assert abs(_eval_loss(tmp_path / "packed") - _eval_loss(tmp_path / "padded")) <= 1e-5


@pytest.mark.distributed
def test_packed_runs_resume_exactly_and_match_one_process_on_ddp_zero3_and_tp2(
    chat: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Packed rows are fixed once, so a resumed run continues bitwise, and two DDP ranks, two
    ZeRO-3 ranks (FSDP2 shards; each rank a micro-batch) and two tensor-parallel ranks
    (transformers' tp_plan: the mask reaches sharded heads) take the micro-batches one process
    takes (within 1e-5: other reductions)."""
    model_dir, _, data = chat
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--seq-length", str(SEQ), "--packing"),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2"),
        *("--train-iters", "6", "--log-interval", "1", "--eval-interval", "1000"),
    ]
    assert main([*flags, "--save", str(tmp_path / "one"), "--save-interval", "3"]) == 0
    resumed = [*flags, "--load", str(tmp_path / "one" / "iter_0000003")]
    assert main([*resumed, "--save", str(tmp_path / "resumed")]) == 0
    one, again = read_losses(tmp_path / "one"), read_losses(tmp_path / "resumed")
    assert again.keys() == {4, 5, 6} and all(again[s] == one[s] for s in again)
    layouts = {
        "ddp": [],
        "zero3": ["--sharding", "zero3"],
        "tp2": ["--tensor-model-parallel-size", "2"],
    }
    for name, layout in layouts.items():
        two_ranks = ["--nproc-per-node", "2", *flags, *layout, "--save", str(tmp_path / name)]
        launched(two_ranks)
        two = read_losses(tmp_path / name)
        gap = max(abs(one[s] - two[s]) for s in one)
        print(name, "largest loss gap to one process:", gap)
        assert two.keys() == one.keys() and gap <= 1e-5, (name, two, one)


def test_rendered_samples_are_cached_beside_the_dataset(
    chat: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The second preparation of the same file reads the first's rendering (equal rows); another
    template or length renders again."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    model_dir, template, data = chat
    copy = tmp_path / "train.jsonl"
    copy.write_text((data / "train.jsonl").read_text())  # a file no other test has cached
    rows = load_dataset("json", data_files={"train": str(copy)})["train"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def prepare(seq_length: int = SEQ, chat_template: str | None = None) -> Any:
        task = CausalLM(tokenizer, seq_length, chat=ChatOptions(chat_template=chat_template))
        return task.prepare(rows, "train")

    first, second = prepare(), prepare()
    assert not any("cache" in note for note in first.extra["notes"])
    said = [note for note in second.extra["notes"] if "read from the cache" in note]
    assert len(said) == 1 and said[0].startswith("train: rendered samples read from the cache ")
    assert "/" not in said[0] and "rapidformer-chat-" in said[0]  # the file's name, not the path
    assert second.rows == first.rows
    other = prepare(chat_template=template.read_text() + " ")
    shorter = prepare(seq_length=64)
    assert not any("cache" in n for n in [*other.extra["notes"], *shorter.extra["notes"]])
    assert shorter.rows != first.rows


def _tamper(name: str, record: dict[str, Any], vocab: int) -> None:
    """Edit a cached rendering the way a hostile or careless hand would."""
    row = record["rows"][0]
    if name == "poisoned-labels":
        row["labels"] = [7 if label != -100 else label for label in row["labels"]]
    elif name == "short-labels":
        row["labels"] = row["labels"][:-3]
    elif name == "id-beyond-vocabulary":
        row["input_ids"][1] = vocab + 5
    elif name == "longer-than-seq-length":
        record["rows"][0] = {k: v * 40 for k, v in row.items()}


@pytest.mark.parametrize(
    "damage", ["poisoned-labels", "short-labels", "id-beyond-vocabulary", "longer-than-seq-length"]
)
@pytest.mark.parametrize("checksum", ["stale", "recomputed"])
def test_an_edited_cache_is_never_trained_on(
    chat: tuple[Path, Path, Path],
    tmp_path: Path,
    damage: str,
    checksum: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cached rendering is checked as strictly as a rendering: an edit caught by its checksum
    or (where the checksum was made again) by what the rows hold is rendered again, with a
    warning, and the rows are the true ones."""
    import hashlib

    from datasets import load_dataset
    from transformers import AutoTokenizer

    model_dir, _, data = chat
    copy = tmp_path / "train.jsonl"
    copy.write_text((data / "train.jsonl").read_text())
    rows = load_dataset("json", data_files={"train": str(copy)})["train"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = CausalLM(tokenizer, SEQ, chat=ChatOptions())
    truth = task.prepare(rows, "train").rows
    (cache,) = Path(rows.cache_files[0]["filename"]).parent.glob("rapidformer-chat-*.json")
    record = json.loads(cache.read_text())
    _tamper(damage, record, len(tokenizer))
    if checksum == "recomputed":
        record["checksum"] = hashlib.sha256(
            json.dumps(record["rows"], sort_keys=True).encode()
        ).hexdigest()
    cache.write_text(json.dumps(record))
    again = task.prepare(rows, "train")
    assert again.rows == truth
    assert not any("read from the cache" in note for note in again.extra["notes"])
    assert f"the cache {cache}" in caplog.text and "rendered again" in caplog.text


def test_packing_composes_with_the_fused_loss_and_recompute(
    chat: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The fused LM loss reads the packed labels (each sample's first token ignored) and
    recomputation replays the masked attention: the same losses as the plain packed run.
    Adapters start from the plain run's first loss (B = 0) and learn."""
    model_dir, _, data = chat
    flags = [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir)),
        *("--data-dir", str(data), "--seq-length", str(SEQ), "--packing"),
        *("--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "4"),
        *("--log-interval", "1", "--eval-interval", "1000"),
    ]
    runs = {"plain": [], "fused": ["--fused-lm-loss"],
            "full": ["--recompute-granularity", "full"],
            "selective": ["--recompute-granularity", "selective"],
            "lora": ["--lora-rank", "8"]}  # fmt: skip
    losses = {}
    for name, extra in runs.items():
        assert main([*flags, *extra, "--save", str(tmp_path / name)]) == 0
        losses[name] = read_losses(tmp_path / name)
    for name in ("fused", "full", "selective"):
        assert max(abs(losses[name][s] - losses["plain"][s]) for s in range(1, 5)) <= 1e-5
    assert abs(losses["lora"][1] - losses["plain"][1]) <= 1e-5
    assert losses["lora"][4] < losses["lora"][1]
