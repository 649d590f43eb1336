"""Learn a small BPE or WordPiece vocabulary, the same one on every run and every machine.

The Rust ``tokenizers`` trainers break ties between equally frequent pairs by ids they hand
out in hash-map order, so two runs over the same texts learn different vocabularies (seen:
the tiny test models' 278 WordPiece tokens differed in every process, and with them what a
fine-tuning test learned in 120 steps). Here a tie goes to the smallest pair in string order.

The algorithm is plain greedy BPE: count the words, start from their characters, and merge the
most frequent adjacent pair until the vocabulary is full or no pair is left. WordPiece's
vocabulary is learnt the same way (as the ``tokenizers`` WordPiece trainer does), with a
``##`` prefix on every piece that continues a word.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

Pair = tuple[str, str]
CONTINUATION = "##"


class _Words:
    """The distinct words as lists of symbols, with each adjacent pair's count and where it
    occurs, updated merge by merge."""

    def __init__(self, counts: Counter[tuple[str, ...]]) -> None:
        self.symbols = [list(word) for word in sorted(counts)]
        self.counts = [counts[word] for word in sorted(counts)]
        self.pairs: Counter[Pair] = Counter()
        self.where: defaultdict[Pair, set[int]] = defaultdict(set)
        # Most frequent first, then the smallest pair; entries go stale as counts change and
        # are checked against ``pairs`` when they come up.
        self._heap: list[tuple[int, Pair]] = []
        for index in range(len(self.symbols)):
            self._count(index, +1)

    def _count(self, index: int, sign: int) -> None:
        word, n = self.symbols[index], self.counts[index]
        for pair in itertools.pairwise(word):
            self.pairs[pair] += sign * n
            if sign > 0:
                self.where[pair].add(index)
                heapq.heappush(self._heap, (-self.pairs[pair], pair))

    def best(self) -> Pair | None:
        """The most frequent pair (the smallest among equals), or None when none is left."""
        while self._heap:
            negative, pair = heapq.heappop(self._heap)
            current = self.pairs.get(pair, 0)
            if current == -negative and current > 0:
                return pair
            if current > 0:
                heapq.heappush(self._heap, (-current, pair))
        return None

    def merge(self, pair: Pair, joined: str) -> None:
        for index in sorted(self.where.pop(pair, ())):
            word = self.symbols[index]
            merged = _join(word, pair, joined)
            if len(merged) == len(word):
                continue  # a stale entry: this word no longer holds the pair
            self._count(index, -1)
            self.symbols[index] = merged
            self._count(index, +1)
        self.pairs.pop(pair, None)


def _join(word: list[str], pair: Pair, joined: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_bpe(
    words: Iterable[str], alphabet: Iterable[str], specials: list[str], vocab_size: int
) -> tuple[dict[str, int], list[Pair]]:
    """GPT-2-style byte-level BPE over pre-tokenized ``words``: the vocabulary (the specials,
    then the alphabet and every character seen, sorted, then merged tokens in merge order) and
    the merges, in order."""
    counts = Counter(tuple(word) for word in words)
    symbols = sorted(set(alphabet) | {c for word in counts for c in word})
    vocab = _numbered([*specials, *symbols])
    merges: list[Pair] = []
    table = _Words(counts)
    while len(vocab) < vocab_size and (pair := table.best()) is not None:
        joined = pair[0] + pair[1]
        table.merge(pair, joined)
        merges.append(pair)
        vocab.setdefault(joined, len(vocab))
    return vocab, merges


def learn_wordpiece(
    words: Iterable[str], alphabet: Iterable[str], specials: list[str], vocab_size: int
) -> dict[str, int]:
    """A WordPiece vocabulary over pre-tokenized ``words``: the specials; every character of
    the alphabet and of the words, sorted; the ``##`` continuations of the characters the words
    continue with, sorted; then the merged pieces in merge order."""
    counts = Counter((word[0], *(CONTINUATION + c for c in word[1:])) for word in words if word)
    continuing = {c for word in counts for c in word[1:]}
    characters = set(alphabet) | {word[0] for word in counts}
    characters |= {c[len(CONTINUATION) :] for c in continuing}
    symbols = sorted(characters) + sorted(continuing)
    vocab = _numbered([*specials, *symbols])
    table = _Words(counts)
    while len(vocab) < vocab_size and (pair := table.best()) is not None:
        joined = pair[0] + pair[1][len(CONTINUATION) :]  # the second piece always continues
        table.merge(pair, joined)
        vocab.setdefault(joined, len(vocab))
    return vocab


def _numbered(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab
