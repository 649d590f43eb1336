"""rapidformer-preprocess: jsonl -> .bin/.idx, checked token by token against the tokenizer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rapidformer.data import preprocess as pp
from rapidformer.data.indexed import IndexedDataset
from rapidformer.data.preprocess import build_parser, main, split_sentences
from rapidformer.data.tokenizers import RapidTokenizer, build_tokenizer, train_tokenizer
from rapidformer.errors import DataError

pytestmark = pytest.mark.timeout(180)  # --workers 2 once hung here: a hang fails in 3 minutes

WORDS_TEXT = (
    "the quick brown fox jumps over a lazy dog while data flows through every token of the "
    "model and training makes it learn café naïve résumé über zebra 42 1999 hello world"
)
WORDS = WORDS_TEXT.split()


def sentence(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
    return words[0].upper() + words[1:] + rng.choice([".", "!", "?"])


def documents(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        text = " ".join(sentence(rng) for _ in range(rng.randint(0, 4)))  # some are empty
        docs.append({"text": text, "title": f"Doc {i}: {rng.choice(WORDS)}", "id": str(i)})
    docs[3]["text"] = "Dr. Smith met J. R. Smith at 3 p.m. on the dock.\n\nThen they left! Why?"
    return docs


def write_jsonl(path: Path, docs: list[dict[str, str]]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("pre")
    docs = documents(150)
    texts = [d["text"] for d in docs] + [d["title"] for d in docs]
    gpt2 = train_tokenizer(texts, "GPT2BPETokenizer", str(root / "gpt2"), vocab_size=400)
    bert = train_tokenizer(texts, "BertWordPieceLowerCase", str(root / "bert"), vocab_size=400)
    return {"root": root, "docs": docs, "input": write_jsonl(root / "c.jsonl", docs)} | {
        "gpt2": gpt2,
        "bert": bert,
    }


def tokenizer_flags(setup: dict, kind: str) -> list[str]:
    vocab, merges = setup["gpt2" if kind == "GPT2BPETokenizer" else "bert"]
    flags = ["--tokenizer-type", kind, "--vocab-file", vocab]
    return flags + (["--merge-file", merges] if merges else [])


def reference(
    tok: RapidTokenizer, texts: list[str], split: bool, eod: bool
) -> tuple[list[list[int]], list[int]]:
    """Sequences and document index that preprocessing must write, from the tokenizer."""
    sequences: list[list[int]] = []
    doc_idx = [0]
    for text in texts:
        pieces = split_sentences(text) if split else [text]
        ids = [tok.tokenize(p) for p in pieces]
        ids = [s for s in ids if s]
        if not ids:
            continue  # empty documents are skipped
        if eod:
            ids[-1] = [*ids[-1], tok.eod]
        sequences += ids
        doc_idx.append(len(sequences))
    return sequences, doc_idx


def check_dataset(prefix: str, sequences: list[list[int]], doc_idx: list[int]) -> None:
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert ds.doc_idx.tolist() == doc_idx
    assert ds.sizes.tolist() == [len(s) for s in sequences]
    assert [ds[i].tolist() for i in range(len(ds))] == sequences


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("eod", [False, True])
def test_round_trip_gpt2(
    setup: dict, tmp_path: Path, split: bool, eod: bool, capsys: pytest.CaptureFixture
) -> None:
    prefix = str(tmp_path / "out" / "corpus")
    argv = ["--input", setup["input"], "--json-keys", "text", "title", "--output-prefix", prefix]
    argv += [*tokenizer_flags(setup, "GPT2BPETokenizer"), "--log-interval", "100"]
    argv += ["--append-eod"] * eod + ["--split-sentences"] * split
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Processed 1" in err and "docs/s" in err and "MB/s" in err
    tok = build_tokenizer("GPT2BPETokenizer", *setup["gpt2"])
    level = "sentence" if split else "document"
    for key in ("text", "title"):
        texts = [d[key] for d in setup["docs"]]
        sequences, doc_idx = reference(tok, texts, split, eod)
        check_dataset(f"{prefix}_{key}_{level}", sequences, doc_idx)
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"corpus_{key}_{level}.{ext}" for key in ("text", "title") for ext in ("bin", "idx")
    )


def test_round_trip_details(setup: dict, tmp_path: Path) -> None:
    """Hand-counted facts of the round trip, independent of the reference function."""
    tok = build_tokenizer("GPT2BPETokenizer", *setup["gpt2"])
    texts = [d["text"] for d in setup["docs"]]
    nonempty = [t for t in texts if t]
    assert 0 < len(nonempty) < len(texts)
    prefix = str(tmp_path / "c")
    flags = tokenizer_flags(setup, "GPT2BPETokenizer")
    assert main(["--input", setup["input"], "--output-prefix", prefix, *flags]) == 0
    ds = IndexedDataset(prefix + "_text_document")
    assert len(ds) == len(nonempty) and ds.doc_idx.tolist() == list(range(len(nonempty) + 1))
    assert ds[3 - texts[:3].count("")].tolist() == tok.tokenize(texts[3])
    assert tok.detokenize(ds[0]) == nonempty[0]
    assert main(["--input", setup["input"], "--output-prefix", prefix, *flags, "--append-eod"]) == 0
    ds = IndexedDataset(prefix + "_text_document")
    assert all(ds[i][-1] == tok.eod for i in range(len(ds)))
    assert tok.detokenize(ds[0]) == nonempty[0] + "<|endoftext|>"
    assert (
        main(["--input", setup["input"], "--output-prefix", prefix, *flags, "--split-sentences"])
        == 0
    )
    ds = IndexedDataset(prefix + "_text_sentence")
    doc3 = 3 - texts[:3].count("")
    start, stop = ds.doc_idx[doc3], ds.doc_idx[doc3 + 1]
    assert [tok.detokenize(ds[i]) for i in range(start, stop)] == [
        "Dr. Smith met J. R. Smith at 3 p.m. on the dock.",
        "Then they left!",
        "Why?",
    ]


def test_round_trip_bert_split_sentences(setup: dict, tmp_path: Path) -> None:
    prefix = str(tmp_path / "bert")
    argv = ["--input", setup["input"], "--output-prefix", prefix, "--split-sentences"]
    argv += [*tokenizer_flags(setup, "BertWordPieceLowerCase"), "--append-eod"]
    assert main(argv) == 0
    tok = build_tokenizer("BertWordPieceLowerCase", *setup["bert"])
    sequences, doc_idx = reference(tok, [d["text"] for d in setup["docs"]], True, True)
    assert all(s[-1] == tok.sep for s in (sequences[i - 1] for i in doc_idx[1:]))
    check_dataset(prefix + "_text_sentence", sequences, doc_idx)


def test_workers_give_identical_bytes(
    setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pp, "CHUNK_LINES", 7)  # many chunks: their order matters
    outputs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        argv = ["--input", setup["input"], "--output-prefix", prefix, "--workers", str(workers)]
        argv += ["--json-keys", "text", "title", "--split-sentences", "--append-eod"]
        assert main(argv + tokenizer_flags(setup, "GPT2BPETokenizer")) == 0
        outputs.append(
            [
                Path(f"{prefix}_{key}_sentence.{ext}").read_bytes()
                for key in ("text", "title")
                for ext in ("bin", "idx")
            ]
        )
    assert outputs[0] == outputs[1]
    assert all(len(blob) > 100 for blob in outputs[0])


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_lines_name_the_file_and_line(
    setup: dict, tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pp, "CHUNK_LINES", 4)
    good = [json.dumps(d) for d in setup["docs"][:20]]
    cases = {
        "not json": ([*good[:12], '{"text": "unterminated', *good[12:]], r":13: not a valid JSON"),
        "no key": ([*good[:9], '{"body": "x"}', *good[9:]], r":10: no key 'text'"),
        "not str": ([*good[:5], '{"text": 3}', *good[5:]], r":6: the value of 'text' must be"),
        "not object": ([*good, "[1, 2]"], r":21: expected a JSON object"),
    }
    for name, (lines, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        prefix = str(tmp_path / "out" / name.replace(" ", "_"))
        argv = ["--input", str(path), "--output-prefix", prefix, "--workers", str(workers)]
        args = build_parser().parse_args(argv + tokenizer_flags(setup, "GPT2BPETokenizer"))
        with pytest.raises(DataError, match=message) as info:
            pp.preprocess(args)
        assert str(path) in str(info.value)
        # nothing half-written is left behind
        assert os.listdir(tmp_path / "out") == []


def test_cli_errors_exit_2(setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": oops}\n', encoding="utf-8")
    flags = tokenizer_flags(setup, "GPT2BPETokenizer")
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert f"rapidformer-preprocess: error: {path}:3: not a valid JSON line" in err
    missing = str(tmp_path / "missing.jsonl")
    assert main(["--input", missing, "--output-prefix", str(tmp_path / "o"), *flags]) == 2
    assert missing in capsys.readouterr().err
    argv = ["--input", setup["input"], "--output-prefix", str(tmp_path / "o")]
    argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", setup["gpt2"][0]]
    assert main(argv) == 2
    assert "--merge-file" in capsys.readouterr().err
    argv = ["--input", setup["input"], "--output-prefix", str(tmp_path / "o"), "--workers", "0"]
    assert main(argv + flags) == 2
    assert "--workers=0: must be at least 1" in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_split_sentences() -> None:
    text = (
        'He said "Stop." Then he left! Did he? Yes... 3 cats ran. Mr. Brown and Dr. Who '
        "arrived, e.g. at 2.5 p.m. with J. R. R. Tolkien. (Quoted.) The end\n\nNew paragraph "
        "here. lower case after a period stays."
    )
    assert split_sentences(text) == [
        'He said "Stop."',
        "Then he left!",
        "Did he?",
        "Yes...",
        "3 cats ran.",
        "Mr. Brown and Dr. Who arrived, e.g. at 2.5 p.m. with J. R. R. Tolkien.",
        "(Quoted.)",
        "The end",
        "New paragraph here. lower case after a period stays.",
    ]
    assert split_sentences("") == [] and split_sentences("  \n\n ") == []
    assert split_sentences("Über alles. Ärger folgt.") == ["Über alles.", "Ärger folgt."]


def test_module_entry_point(setup: dict, tmp_path: Path) -> None:
    prefix = str(tmp_path / "m")
    vocab = setup["bert"][0]
    argv = ["--input", setup["input"], "--output-prefix", prefix, "--json-keys", "id"]
    argv += ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    result = subprocess.run(
        [sys.executable, "-m", "rapidformer.data.preprocess", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Done: 150 documents" in result.stderr
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    ds = IndexedDataset(prefix + "_id_document", impl="infer")
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(str(i)) for i in range(150)]
