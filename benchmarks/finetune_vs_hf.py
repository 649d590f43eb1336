"""Fine-tuning throughput: rapidformer's Finetuner vs transformers' Trainer, same tiny BERT.

The task: sequence classification of generated documents (1 to 12 sentences of the demo
grammar, label = the first sentence's verb, 4 classes), so lengths vary from ~12 to --seq-length
tokens. The same pretrained tiny BERT (rapidformer.testing.tiny_model, hidden 128, 2 layers),
tokenizer, micro batch, learning rate, schedule, weight decay and gradient clipping run through
four set-ups:

- rapidformer, fixed shape: every batch padded to --seq-length (the Finetuner's default);
- transformers' Trainer, fixed shape: ``DataCollatorWithPadding(padding="max_length")``;
- rapidformer, ``--data-iterator dynamic-shape``: length-grouped batches padded to buckets;
- transformers' Trainer at its best on variable lengths: ``train_sampling_strategy=
  "group_by_length"`` (its length-grouped sampler) and padding to
  each batch's longest sample.

Throughput is training samples per second from the start of the first step to the end of the
last (model loading and tokenization excluded for both). Runs alternate after a warm-up of
each; medians and ratios are reported. transformers' Trainer needs ``accelerate``
(``pip install -c constraints.txt accelerate``).

    .venv/bin/python benchmarks/finetune_vs_hf.py           # full run, writes result files
    .venv/bin/python benchmarks/finetune_vs_hf.py --quick   # smoke test, writes nothing
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import argument_parser, stamp, write_results

from rapidformer import Finetuner, parse_args
from rapidformer.testing.corpus import OBJECTS, PLACES, SUBJECTS, VERBS
from rapidformer.testing.finetune import tiny_model

SEQ, HIDDEN, MICRO_BATCH, SAMPLES, LR = 128, 128, 16, 2048, 1e-3
SETUPS = ("rapidformer fixed", "transformers fixed", "rapidformer dynamic", "transformers grouped")


def documents(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Texts of 1-12 sentences (most short), labelled by the first sentence's verb."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        sentences = min(12, max(1, int(rng.lognormvariate(0.6, 0.8))))
        verbs = [rng.choice(VERBS[:4])] + [rng.choice(VERBS) for _ in range(sentences - 1)]
        text = " ".join(
            f"{rng.choice(SUBJECTS)} {verb} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
            for verb in verbs
        )
        rows.append({"text": text, "label": VERBS.index(verbs[0])})
    return rows


class TimedFinetuner(Finetuner):
    """Records when the first training step starts."""

    first_step: float | None = None

    def train_step(self, batch: Any) -> Any:
        if self.first_step is None:
            self.first_step = time.perf_counter()
        return super().train_step(batch)


def run_rapidformer(model: Path, data: Path, steps: int, iterator: str) -> dict[str, float]:
    config = parse_args([
        "--task", "sequence_classification", "--pretrained-model-name-or-path", str(model),
        "--data-dir", str(data), "--seq-length", str(SEQ), "--train-iters", str(steps),
        "--micro-batch-size", str(MICRO_BATCH), "--lr", str(LR), "--log-interval", "100000",
        "--data-iterator", iterator,
    ])  # fmt: skip
    trainer = TimedFinetuner(config)
    try:
        metrics = trainer.fit()
        end = time.perf_counter()
    finally:
        trainer.engine.close()
    assert trainer.first_step is not None
    return {"samples_per_s": steps * MICRO_BATCH / (end - trainer.first_step), **metrics}


def run_transformers(
    model: Path, rows: list[dict[str, Any]], steps: int, grouped: bool
) -> dict[str, float]:
    import datasets
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(model)
    train = datasets.Dataset.from_list(rows).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=SEQ),
        batched=True,
        remove_columns=["text"],
    )
    classifier = AutoModelForSequenceClassification.from_pretrained(model, num_labels=4)
    padding: dict[str, Any] = {} if grouped else {"padding": "max_length", "max_length": SEQ}
    times: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.setdefault("first_step", time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out, per_device_train_batch_size=MICRO_BATCH, max_steps=steps,
            learning_rate=LR, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear",
            logging_steps=100000, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, seed=1234,
            train_sampling_strategy="group_by_length" if grouped else "random",
        )  # fmt: skip
        trainer = Trainer(
            model=classifier,
            args=arguments,
            train_dataset=train,
            data_collator=DataCollatorWithPadding(tokenizer, **padding),
            callbacks=[Clock()],
        )
        output = trainer.train()
        end = time.perf_counter()
    return {
        "samples_per_s": steps * MICRO_BATCH / (end - times["first_step"]),
        "train_loss": float(output.training_loss),
    }


def run(
    setup: str, model: Path, data: Path, rows: list[dict[str, Any]], steps: int
) -> dict[str, float]:
    if setup.startswith("rapidformer"):
        iterator = "dynamic-shape" if setup.endswith("dynamic") else "fixed-shape"
        return run_rapidformer(model, data, steps, iterator)
    return run_transformers(model, rows, steps, grouped=setup.endswith("grouped"))


def _losses(runs: list[dict[str, float]]) -> str:
    return ", ".join(f"{r['train_loss']:.3f}" for r in runs)


def main() -> None:
    parser = argument_parser(__doc__, "5 steps, 1 round")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps, rounds = (5, 1) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model("bert", Path(tmp) / "bert", hidden=HIDDEN, max_positions=SEQ)
        rows = documents(SAMPLES)
        data = Path(tmp) / "data"
        data.mkdir()
        (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for setup in SETUPS:  # warm-up: first-call costs land here
            run(setup, model, data, rows, 3)
        results: dict[str, list[dict[str, float]]] = {s: [] for s in SETUPS}
        for index in range(rounds):
            for setup in SETUPS:
                result = run(setup, model, data, rows, steps)
                results[setup].append(result)
                print(
                    f"round {index + 1}/{rounds} {setup:21s} {result['samples_per_s']:7.1f} "
                    f"samples/s  loss {result['train_loss']:.3f}"
                )
    median = {s: statistics.median(r["samples_per_s"] for r in rs) for s, rs in results.items()}
    ratios = {
        "fixed: rapidformer / transformers": median["rapidformer fixed"]
        / median["transformers fixed"],
        "rapidformer dynamic / transformers fixed": median["rapidformer dynamic"]
        / median["transformers fixed"],
        "rapidformer dynamic / transformers grouped": median["rapidformer dynamic"]
        / median["transformers grouped"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    if args.quick:
        return
    lengths = sorted(len(r["text"].split()) for r in rows)
    result = stamp(
        {
            "steps": steps,
            "rounds": rounds,
            "seq_length": SEQ,
            "median_samples_per_s": median,
            "ratios": ratios,
            "runs": results,
        }
    )
    write_results("finetune_vs_hf", result, [
        "# Fine-tuning: rapidformer vs transformers' Trainer",
        "",
        f"Tiny BERT (hidden {HIDDEN}, 2 layers, WordPiece vocabulary of at most 300), "
        "sequence classification of "
        f"{SAMPLES} generated documents (words per document: median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}; truncated to --seq-length {SEQ} tokens), micro batch {MICRO_BATCH}, "
        f"{steps} steps per run, {rounds} interleaved rounds after a warm-up, 2 torch threads, "
        "CPU. Samples/s from the first step's start to the last step's end.",
        "",
        "| set-up | median samples/s | final train losses |",
        "|---|---|---|",
        *(f"| {s} | {median[s]:.1f} | {_losses(results[s])} |" for s in SETUPS),
        "",
        *(f"- **{name}: {ratio:.2f}x**" for name, ratio in ratios.items()),
        "",
        "transformers reports the mean training loss over all steps, rapidformer the last "
        "step's loss: the columns show that both train, not the same number.",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
