"""The tokenizers of the pretraining data, on the fast Rust ``tokenizers`` library, built from
local vocabulary files.

Three types, named as in Megatron-LM's ``--tokenizer-type``:

* ``BertWordPieceLowerCase``: WordPiece over BERT's pre-tokenization (split on whitespace and
  punctuation, CJK characters alone), after lower-casing and stripping accents; ``vocab.txt``
  with one token per line, the line number being the id.
* ``BertWordPieceCase``: the same without lower-casing or accent stripping.
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE (GPT-2's splitting regex, no prefix space) from
  ``vocab.json`` (token -> id) and ``merges.txt`` (one merge per line, an optional
  ``#version`` first line).

:meth:`RapidTokenizer.tokenize` adds no special tokens (no [CLS]/[SEP], no end of document):
the data pipeline places them. Special-token strings written in the text ("[SEP]",
"<|endoftext|>") are recognised as the special tokens, as the Hugging Face tokenizer of
:meth:`RapidTokenizer.to_hf` does, so the two give the same ids.
"""

from __future__ import annotations

import importlib
import json
import os
import string
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from rapidformer.data.vocab_training import learn_bpe, learn_wordpiece
from rapidformer.errors import ConfigError, DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer")
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
GPT2_EOD = "<|endoftext|>"


class RapidTokenizer:
    """A tokenizer of one of :data:`TOKENIZER_TYPES` with Megatron's special-id attributes."""

    def __init__(
        self,
        name: str,
        backend: Tokenizer,
        vocab: dict[str, int],
        merges: list[tuple[str, str]] | None = None,
    ) -> None:
        self.name = name
        """The tokenizer type, e.g. ``"GPT2BPETokenizer"``."""
        self.backend = backend
        """The underlying ``tokenizers.Tokenizer``."""
        self._vocab = vocab
        self._merges = merges
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        """Number of ids (the largest id + 1)."""
        self.cls: int | None = None
        self.sep: int | None = None
        self.mask: int | None = None
        if is_bert(name):
            self.cls, self.sep, self.mask = (vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]"))
            self.eod = vocab["[SEP]"]
            """End-of-document id: ``<|endoftext|>`` for GPT-2, ``[SEP]`` for BERT."""
            self.pad = vocab["[PAD]"]
            """Padding id: ``[PAD]`` for BERT, the end-of-document id for GPT-2."""
        else:
            self.eod = vocab[GPT2_EOD]
            self.pad = self.eod
        self._inv_vocab: dict[int, str] | None = None

    @property
    def lowercase(self) -> bool:
        return self.name == "BertWordPieceLowerCase"

    @property
    def vocab(self) -> dict[str, int]:
        """Token -> id (a copy)."""
        return dict(self._vocab)

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token."""
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self._vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens added."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        return ids

    def detokenize(self, ids: Iterable[Any]) -> str:
        """The text of ``ids`` (special tokens kept)."""
        text: str = self.backend.decode([int(i) for i in ids], skip_special_tokens=False)
        return text

    def to_hf(self) -> PreTrainedTokenizerFast:
        """The equivalent ``transformers`` tokenizer (``BertTokenizerFast`` or
        ``GPT2TokenizerFast``), e.g. to ``save_pretrained`` it next to an exported model."""
        # transformers 5 ignores vocab_file= / merges_file= silently (every token becomes [UNK]):
        # pass the vocabulary and merges as objects. (transformers 5 exports the *Fast names
        # lazily, which type checkers do not see: hence the module lookup.)
        transformers = importlib.import_module("transformers")
        if int(transformers.__version__.split(".")[0]) < 5:
            raise RuntimeError(
                f"to_hf() needs transformers >= 5 (found {transformers.__version__}): older "
                "versions do not take the vocabulary as an object"
            )
        hf: PreTrainedTokenizerFast
        if is_bert(self.name):
            lower = self.lowercase
            hf = transformers.BertTokenizerFast(
                vocab=dict(self._vocab), do_lower_case=lower, strip_accents=lower
            )
        else:
            hf = transformers.GPT2TokenizerFast(
                vocab=dict(self._vocab),
                merges=list(self._merges or []),
                unk_token=GPT2_EOD,
                bos_token=GPT2_EOD,
                eos_token=GPT2_EOD,
                pad_token=GPT2_EOD,
                add_prefix_space=False,
            )
        return hf

    def __repr__(self) -> str:
        return f"RapidTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def is_bert(tokenizer_type: str) -> bool:
    return tokenizer_type.startswith("BertWordPiece")


def _check_type(tokenizer_type: str) -> None:
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError.single(
            "--tokenizer-type",
            tokenizer_type,
            f"must be one of {', '.join(TOKENIZER_TYPES)}",
            "pick one of them",
        )


def _bert_backend(vocab: dict[str, int], lowercase: bool) -> Tokenizer:
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    return backend


def _gpt2_backend(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _read_text(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise DataError(f"{path}: {what} not found. Fix: check --vocab-file / --merge-file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: {what} is not UTF-8 text ({exc})") from exc


def load_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    """``vocab.txt``: one token per line, id = line number (a repeated token keeps its last id,
    as in Hugging Face's loader)."""
    lines = _read_text(vocab_file, "vocabulary file").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab = {token.rstrip("\r"): i for i, token in enumerate(lines)}
    missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise DataError(
            f"{vocab_file}: not a BERT WordPiece vocabulary: it lacks {', '.join(missing)}"
        )
    return vocab


def load_bpe_files(
    vocab_file: str, merge_file: str
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's ``vocab.json`` and ``merges.txt``."""
    try:
        vocab = json.loads(_read_text(vocab_file, "vocabulary file"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{vocab_file}: vocabulary file is not valid JSON ({exc})") from exc
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{vocab_file}: a GPT-2 vocab.json must map tokens to integer ids")
    if GPT2_EOD not in vocab:
        raise DataError(f"{vocab_file}: the GPT-2 vocabulary lacks {GPT2_EOD}")
    merges: list[tuple[str, str]] = []
    for number, line in enumerate(_read_text(merge_file, "merges file").splitlines(), 1):
        if (number == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise DataError(f"{merge_file}:{number}: a merge is two tokens, got {line!r}")
        merges.append((parts[0], parts[1]))
    if not merges:  # every word would split into single bytes: a tokenizer that learned nothing
        raise DataError(
            f"{merge_file}: the merges file holds no merge. Fix: pass the merges.txt that was "
            "made with --vocab-file (GPT-2's has 50,000 merges)"
        )
    return vocab, merges


def build_tokenizer(
    tokenizer_type: str, vocab_file: str, merge_file: str | None = None
) -> RapidTokenizer:
    """The tokenizer ``tokenizer_type`` from its local files."""
    _check_type(tokenizer_type)
    if is_bert(tokenizer_type):
        vocab = load_wordpiece_vocab(vocab_file)
        backend = _bert_backend(vocab, lowercase=tokenizer_type == "BertWordPieceLowerCase")
        specials: Sequence[str] = BERT_SPECIAL_TOKENS
        merges = None
    else:
        if merge_file is None:
            raise ConfigError.single(
                "--merge-file",
                None,
                "GPT2BPETokenizer needs the BPE merges file next to --vocab-file",
                "pass --merge-file merges.txt",
            )
        vocab, merges = load_bpe_files(vocab_file, merge_file)
        backend = _gpt2_backend(vocab, merges)
        specials = (GPT2_EOD,)
    # Every special token is in the vocabulary already: this marks it special, it adds no id.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return RapidTokenizer(tokenizer_type, backend, vocab, merges)


def train_tokenizer(
    texts: Iterable[str], tokenizer_type: str, out_dir: str, vocab_size: int = 1000
) -> tuple[str, str | None]:
    """Train a small vocabulary of ``tokenizer_type`` on ``texts`` (offline; for tests and demos)
    and write it to ``out_dir``: ``vocab.txt`` for BERT (with ``[PAD] [UNK] [CLS] [SEP] [MASK]``
    as ids 0-4), ``vocab.json`` + ``merges.txt`` for GPT-2 (with ``<|endoftext|>`` as id 0).
    Returns ``(vocab_file, merge_file or None)``, ready for :func:`build_tokenizer`."""
    _check_type(tokenizer_type)
    os.makedirs(out_dir, exist_ok=True)
    if is_bert(tokenizer_type):
        lower = tokenizer_type == "BertWordPieceLowerCase"
        backend = _bert_backend({"[UNK]": 0}, lowercase=lower)
        letters = string.ascii_lowercase if lower else string.ascii_letters
        vocab = learn_wordpiece(
            _words(backend, texts),
            letters + string.digits + string.punctuation,
            list(BERT_SPECIAL_TOKENS),
            vocab_size,
        )
        vocab_file = os.path.join(out_dir, "vocab.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            f.write("".join(token + "\n" for token in vocab))  # in id order
        return vocab_file, None
    backend = _gpt2_backend({GPT2_EOD: 0}, [])
    vocab, merges = learn_bpe(
        _words(backend, texts), pre_tokenizers.ByteLevel.alphabet(), [GPT2_EOD], vocab_size
    )
    vocab_file, merge_file = (
        os.path.join(out_dir, "vocab.json"),
        os.path.join(out_dir, "merges.txt"),
    )
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_file, merge_file


def _words(backend: Tokenizer, texts: Iterable[str]) -> Iterator[str]:
    """The words ``backend`` would split ``texts`` into (after its normalizer)."""
    for text in texts:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        assert backend.pre_tokenizer is not None
        yield from (word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text))
