"""A small pretraining corpus made offline: generated documents, a trained vocabulary and the
indexed .bin/.idx files, as ``rapidformer-preprocess`` writes them.

The documents are sentences of a tiny grammar ("the old miller carries a lamp near the river.")
so that a few hundred steps of a small model visibly learn word order and agreement.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SUBJECTS = [
    "the old miller",
    "a young girl",
    "the tired soldier",
    "my brother",
    "the farmer",
    "a small dog",
    "the teacher",
    "our neighbour",
    "the baker",
    "a quiet monk",
]
VERBS = [
    "carries",
    "finds",
    "paints",
    "sells",
    "watches",
    "mends",
    "loses",
    "buys",
    "hides",
    "builds",
]
OBJECTS = [
    "a lamp",
    "the bread",
    "a wooden boat",
    "the letters",
    "a red kite",
    "the old map",
    "a basket of apples",
    "the broken clock",
    "a silver ring",
    "the winter coat",
]
PLACES = [
    "near the river",
    "in the market",
    "at dawn",
    "behind the church",
    "by the sea",
    "in the garden",
    "before the storm",
    "on the hill",
    "under the bridge",
    "at night",
]


def synthetic_documents(
    count: int, seed: int = 0, min_sentences: int = 2, max_sentences: int = 12
) -> list[str]:
    """``count`` documents of a few generated sentences each; lengths vary widely."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        sentences = [
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(PLACES)}.".capitalize()
            for _ in range(rng.randint(min_sentences, max_sentences))
        ]
        documents.append(" ".join(sentences))
    return documents


@dataclass(frozen=True)
class PretrainingData:
    """Flags that point a Pretrainer at prepared data."""

    prefix: str
    tokenizer_type: str
    vocab_file: str
    merge_file: str | None

    def flags(self) -> list[str]:
        flags = [
            "--data-path",
            self.prefix,
            "--tokenizer-type",
            self.tokenizer_type,
            "--vocab-file",
            self.vocab_file,
        ]
        return flags + (["--merge-file", self.merge_file] if self.merge_file else [])


def build_pretraining_data(
    out_dir: str | Path, tokenizer_type: str, documents: list[str], vocab_size: int = 400
) -> PretrainingData:
    """Train a vocabulary on ``documents``, write them as jsonl and preprocess them (BERT data
    split into sentences, GPT data with an end-of-document token)."""
    from rapidformer.data.preprocess import main as preprocess
    from rapidformer.data.tokenizers import train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = train_tokenizer(
        documents, tokenizer_type, str(out / "vocab"), vocab_size=vocab_size
    )
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    gpt = tokenizer_type == "GPT2BPETokenizer"
    argv = [
        "--input",
        str(corpus),
        "--output-prefix",
        str(out / "corpus"),
        "--tokenizer-type",
        tokenizer_type,
        "--vocab-file",
        vocab_file,
        "--log-interval",
        "1000000",
    ]
    argv += ["--merge-file", str(merge_file), "--append-eod"] if gpt else ["--split-sentences"]
    if preprocess(argv) != 0:
        raise RuntimeError(f"preprocessing {corpus} failed")
    level = "document" if gpt else "sentence"  # Megatron's naming of the two layouts
    return PretrainingData(
        str(out / f"corpus_text_{level}"), tokenizer_type, vocab_file, merge_file
    )
