"""Black-box GPT pretraining end to end, offline: corpus -> vocabulary -> .bin/.idx -> training
-> Hugging Face export.

    python examples/pretrain_gpt.py --out demo_output/pretrain

Equivalent shell steps (what this script does):

    rapidformer-preprocess --input corpus.jsonl --output-prefix corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod
    rapidformer --task pretraining --data-path corpus_text_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --train-iters 300 --micro-batch-size 8 --global-batch-size 16 --lr 2e-3 --save run
    python -m rapidformer.export run hf
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rapidformer.cli import main as rapidformer
from rapidformer.export import export_checkpoint
from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents


def run(out: Path, iterations: int) -> None:
    shutil.rmtree(out, ignore_errors=True)  # the demo starts fresh (a kept --save would resume)
    data = build_pretraining_data(out / "data", "GPT2BPETokenizer", synthetic_documents(2000))
    code = rapidformer([
        "--task", "pretraining", *data.flags(),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", str(iterations), "--micro-batch-size", "8",
        "--global-batch-size", "16", "--lr", "2e-3", "--lr-warmup-iters", "20",
        "--lr-decay-style", "cosine", "--log-interval", "25", "--eval-interval", "100",
        "--eval-iters", "5", "--save", str(out / "run"),
    ])  # fmt: skip
    if code != 0:
        raise SystemExit(code)
    hf_dir = export_checkpoint(out / "run", out / "hf")
    print(f"pretrained GPT exported for transformers to {hf_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_output/pretrain")
    parser.add_argument("--train-iters", type=int, default=300)
    args = parser.parse_args()
    run(Path(args.out), args.train_iters)
