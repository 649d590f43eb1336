"""Black-box fine-tuning end to end, offline: the GPT that ``examples/pretrain_gpt.py``
pretrained (or, without it, a tiny BERT built here) learns to classify the demo grammar's
sentences by their verb (4 classes, chance 0.25), then reloads with transformers.

    python examples/finetune_classifier.py --out demo_output/finetune \\
        --model demo_output/pretrain/hf

Equivalent shell step (what this script runs):

    rapidformer --task sequence_classification --pretrained-model-name-or-path MODEL \\
        --data-dir data --seq-length 32 --epochs 3 --micro-batch-size 16 \\
        --global-batch-size 32 --lr 1e-3 --save run
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from rapidformer.cli import main as rapidformer
from rapidformer.testing.finetune import task_dataset, tiny_model

BOUND = 0.6
"""Validation accuracy the demo must exceed (chance: 0.25)."""


def run(out: Path, model: Path | None, epochs: int) -> float:
    shutil.rmtree(out, ignore_errors=True)  # a kept --save would resume instead of training
    if model is None or not (model / "config.json").is_file():
        model = tiny_model("bert", out / "tiny-bert", hidden=64)
        print(f"no pretrained model given: built a tiny BERT in {model}")
    data = task_dataset("sequence_classification", out / "data", train=1024, validation=256)
    code = rapidformer([
        "--task", "sequence_classification", "--pretrained-model-name-or-path", str(model),
        "--data-dir", str(data), "--seq-length", "32", "--epochs", str(epochs),
        "--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "1e-3",
        "--lr-warmup-fraction", "0.1", "--log-interval", "16", "--eval-interval", "32",
        "--data-iterator", "dynamic-shape", "--save", str(out / "run"),
    ])  # fmt: skip
    if code != 0:
        raise SystemExit(code)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    accuracy = [r["accuracy"] for r in records if r["kind"] == "eval"][-1]

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    classifier = AutoModelForSequenceClassification.from_pretrained(out / "run").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "run")
    for text in ("The baker paints a red kite at dawn.", "My brother sells the old map."):
        with torch.no_grad():
            logits = classifier(**tokenizer(text, return_tensors="pt")).logits
        label = classifier.config.id2label[int(logits.argmax(-1))]
        print(f"reloaded with transformers: {text!r} -> {label}")
    print(f"validation accuracy {accuracy:.3f} (chance 0.25, demo bound {BOUND})")
    if accuracy <= BOUND:
        raise SystemExit(f"accuracy {accuracy:.3f} is not above {BOUND}")
    return float(accuracy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_output/finetune")
    parser.add_argument("--model", type=Path, default=Path("demo_output/pretrain/hf"))
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    run(Path(args.out), args.model, args.epochs)
