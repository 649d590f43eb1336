"""Token ids the model cannot embed, found before training instead of as an IndexError.

A corpus preprocessed with another tokenizer holds ids beyond this run's vocabulary; the
embedding would fail on the first batch that happens to hold one, with an error naming no
file. The .bin is scanned once at start (memory-mapped, in chunks, about 1 GB/s) when it is
at most :data:`SCAN_LIMIT` bytes; larger corpora are trusted (preprocess records no maximum).
"""

from __future__ import annotations

import os

import numpy as np

from rapidformer.errors import DataError

SCAN_LIMIT = 4 * 2**30
_CHUNK = 64 * 2**20


def check_token_ids(bin_path: str, dtype: np.dtype, vocab_size: int, vocab_file: str) -> None:
    """Raise a :class:`DataError` naming ``bin_path`` if a token id is >= ``vocab_size``."""
    size = os.path.getsize(bin_path)
    if size == 0 or size > SCAN_LIMIT:
        return
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start : start + _CHUNK]
        largest = int(chunk.max())
        if largest >= vocab_size:
            position = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"{bin_path}: token id {int(tokens[position])} (token {position}) is outside "
                f"the vocabulary of --vocab-file {vocab_file} ({vocab_size} entries): the data "
                "was preprocessed with another tokenizer. Fix: preprocess it again with this "
                "--vocab-file (python -m rapidformer.data.preprocess), or pass the --vocab-file "
                "and --merge-file it was made with"
            )
