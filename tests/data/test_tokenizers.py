"""The three tokenizer types, trained offline on a small generated corpus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rapidformer.data.tokenizers import (
    TOKENIZER_TYPES,
    RapidTokenizer,
    build_tokenizer,
    train_tokenizer,
)
from rapidformer.errors import ConfigError, DataError

WORDS_TEXT = (
    "the quick brown fox jumps over a lazy dog while data flows through every token of the "
    "model and training makes it learn café naïve résumé über zebra 42 1999 hello world"
)
WORDS = WORDS_TEXT.split()

SAMPLES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog!",
    "Café naïve RÉSUMÉ, über 42 zebras?",
    "  leading and   inner spaces\nand a newline ",
    "unseenwordxyz qq",
]


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize()
        + rng.choice(".!?,;")
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str | None]]:
    texts = corpus()
    return {
        kind: train_tokenizer(texts, kind, str(tmp_path_factory.mktemp(kind)), vocab_size=400)
        for kind in TOKENIZER_TYPES
    }


def tokenizer(trained: dict[str, tuple[str, str | None]], kind: str) -> RapidTokenizer:
    return build_tokenizer(kind, *trained[kind])


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the others are shifted to 256 and up in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_vocabulary_and_special_ids(trained: dict, kind: str) -> None:
    vocab_file, merge_file = trained[kind]
    assert merge_file is None and Path(vocab_file).name == "vocab.txt"
    lines = Path(vocab_file).read_text(encoding="utf-8").splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = tokenizer(trained, kind)
    assert tok.name == kind and tok.vocab_size == len(lines)
    assert (tok.pad, tok.cls, tok.sep, tok.mask, tok.eod) == (0, 2, 3, 4, 3)
    # a whole word of the vocabulary is its own id; its line number is that id
    the = lines.index("the")
    assert tok.tokenize("the") == [the]
    assert tok.tokenize("the [SEP] the") == [the, 3, the]
    # wordpiece: an unseen word is cut into pieces whose continuations start with ##
    pieces = [tok.inv_vocab[i] for i in tok.tokenize("zebraish")]
    assert len(pieces) > 1 and all(p.startswith("##") for p in pieces[1:])
    assert "".join(p.removeprefix("##") for p in pieces) == "zebraish"


def test_lower_case_folds_case_and_accents(trained: dict) -> None:
    lower = tokenizer(trained, "BertWordPieceLowerCase")
    case = tokenizer(trained, "BertWordPieceCase")
    assert lower.tokenize("THE Café") == lower.tokenize("the cafe")
    assert case.tokenize("THE Café") != case.tokenize("the cafe")
    assert lower.detokenize(lower.tokenize("Café naïve, RÉSUMÉ!")) == "cafe naive, resume!"
    assert case.detokenize(case.tokenize("Café naïve, über!")) == "Café naïve, über!"
    ids = case.tokenize("Hello world.")
    assert [case.inv_vocab[i] for i in ids][-1] == "."
    assert case.detokenize(ids) == "Hello world."


def test_gpt2_vocabulary_special_ids_and_byte_level(trained: dict) -> None:
    vocab_file, merge_file = trained["GPT2BPETokenizer"]
    assert Path(vocab_file).name == "vocab.json" and merge_file is not None
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    assert Path(merge_file).read_text(encoding="utf-8").startswith("#version")
    tok = tokenizer(trained, "GPT2BPETokenizer")
    assert tok.vocab_size == len(vocab) == max(vocab.values()) + 1
    assert tok.eod == tok.pad == vocab["<|endoftext|>"]
    assert (tok.cls, tok.sep, tok.mask) == (None, None, None)
    table = bytes_to_unicode()
    for text in SAMPLES:
        ids = tok.tokenize(text)
        assert tok.eod not in ids
        # the tokens spell the text's UTF-8 bytes through GPT-2's byte table ("Ġ" = space) ...
        mapped = "".join(table[b] for b in text.encode("utf-8"))
        assert "".join(tok.inv_vocab[i] for i in ids) == mapped
        # ... and decoding gives the text back exactly
        assert tok.detokenize(ids) == text
    assert tok.tokenize("a<|endoftext|>b") == [vocab["a"], tok.eod, vocab["b"]]
    assert tok.tokenize(" the") == [vocab["Ġthe"]]
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_to_hf_gives_the_same_ids(trained: dict, kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = tokenizer(trained, kind)
    hf = tok.to_hf()
    expected_class = "GPT2Tokenizer" if kind == "GPT2BPETokenizer" else "BertTokenizer"
    assert type(hf).__name__.startswith(expected_class)
    hf.save_pretrained(str(tmp_path))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*SAMPLES, "the [SEP] <|endoftext|> end"]:
        ids = tok.tokenize(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids) == tok.detokenize(ids)
    if tok.cls is not None:
        assert hf("Hello world.")["input_ids"] == [tok.cls, *tok.tokenize("Hello world."), tok.sep]
        assert (hf.pad_token_id, hf.mask_token_id) == (tok.pad, tok.mask)
    else:
        assert hf.eos_token_id == tok.eod


def test_tokenizer_errors(trained: dict, tmp_path: Path) -> None:
    vocab_json, merges = trained["GPT2BPETokenizer"]
    missing = str(tmp_path / "nope" / "vocab.txt")
    with pytest.raises(DataError, match="not found") as info:
        build_tokenizer("BertWordPieceCase", missing)
    assert missing in str(info.value)
    with pytest.raises(DataError) as info:
        build_tokenizer("GPT2BPETokenizer", vocab_json, str(tmp_path / "merges.txt"))
    assert str(tmp_path / "merges.txt") in str(info.value)
    with pytest.raises(ConfigError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_json)
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer("SentencePiece", vocab_json)
    no_mask = tmp_path / "vocab.txt"
    no_mask.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"lacks \[MASK\]") as info:
        build_tokenizer("BertWordPieceLowerCase", str(no_mask))
    assert str(no_mask) in str(info.value)
    bad_merges = tmp_path / "bad_merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nh e x\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad_merges\.txt:3"):
        build_tokenizer("GPT2BPETokenizer", vocab_json, str(bad_merges))
    not_json = tmp_path / "vocab.json"
    not_json.write_text("{", encoding="utf-8")
    with pytest.raises(DataError, match="not valid JSON") as info:
        build_tokenizer("GPT2BPETokenizer", str(not_json), merges)
    assert str(not_json) in str(info.value)


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_training_twice_writes_the_same_files(kind: str, tmp_path: Path) -> None:
    # The Rust trainers broke ties in hash-map order: every run learnt another vocabulary.
    texts = corpus(seed=3)
    first = train_tokenizer(texts, kind, str(tmp_path / "a"), vocab_size=300)
    second = train_tokenizer(texts, kind, str(tmp_path / "b"), vocab_size=300)
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or Path(a).read_bytes() == Path(b).read_bytes()  # type: ignore[arg-type]


def test_a_tie_goes_to_the_smallest_pair_and_counts_decide_the_rest() -> None:
    from rapidformer.data.vocab_training import learn_bpe, learn_wordpiece

    # "cd" is the most frequent pair; "ab" and "xy" tie after it and "ab" comes first, which
    # fills the vocabulary (9).
    vocab, merges = learn_bpe(["xy", "ab", "cd", "cd"], "", ["<eod>"], vocab_size=9)
    assert merges == [("c", "d"), ("a", "b")]
    assert list(vocab) == ["<eod>", "a", "b", "c", "d", "x", "y", "cd", "ab"]
    pieces = learn_wordpiece(["abc", "abc", "bc"], "", ["[UNK]"], vocab_size=100)
    # ("##b", "##c") and ("a", "##b") tie at 2: "##b" < "a". Then "a" + "##bc", "b" + "##c".
    assert list(pieces)[6:] == ["##bc", "abc", "bc"], list(pieces)  # [UNK] a b c ##b ##c
