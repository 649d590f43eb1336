"""Who says an error on several ranks: a configuration error once per machine (its first
rank), any other error by the rank that met it, each named by its rank except rank 0."""

from __future__ import annotations

import pytest

from rapidformer.errors import ConfigError, DataError
from rapidformer.fatal import report

CONFIG = ConfigError.single("--data-path", "corpus", "the file must exist", "check the path")


@pytest.mark.parametrize(
    ("rank", "local_rank", "said"),
    [
        (0, 0, "rapidformer: error: invalid rapidformer configuration"),
        (1, 1, ""),  # rank 0 of its machine says it
        (8, 0, "rapidformer (rank 8): error: invalid rapidformer configuration"),
    ],
)
def test_a_configuration_error_is_said_once_per_machine(
    rank: int, local_rank: int, said: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert report(CONFIG, debug=False) == 2
    error = capsys.readouterr().err
    assert error.startswith(said) if said else error == ""
    assert error.count("invalid rapidformer configuration") == (1 if said else 0)


def test_other_errors_are_said_by_the_rank_that_met_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert report(DataError("shard_1.bin: truncated"), debug=False) == 2
    assert capsys.readouterr().err == "rapidformer (rank 1): error: shard_1.bin: truncated\n"
