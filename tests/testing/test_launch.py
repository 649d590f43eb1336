"""rapidformer.testing.run_distributed: ranks forked from a fork server still get what a
spawned rank gets from its caller: the environment at the launch, and stdout and stderr."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from rapidformer.testing import run_distributed


def _report(path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} says hello", file=sys.stderr, flush=True)
    seen = {"variable": os.environ.get("RAPIDFORMER_LAUNCH_PROBE"), "rank": os.environ["RANK"]}
    Path(path, f"rank{rank}.json").write_text(json.dumps(seen))


def test_ranks_take_the_callers_environment_and_streams_at_each_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The first launch (outside this test's capture) may start the server: the second must
    still write to this test's stderr and see the variable as it is now."""
    for launch, value in enumerate(("first", "second")):
        monkeypatch.setenv("RAPIDFORMER_LAUNCH_PROBE", value)
        out = tmp_path / str(launch)
        out.mkdir()
        if launch == 0:
            with capfd.disabled():
                run_distributed(_report, 2, str(out))
            said = None
        else:
            capfd.readouterr()
            run_distributed(_report, 2, str(out))
            said = capfd.readouterr().err
        for rank in range(2):
            seen = json.loads((out / f"rank{rank}.json").read_text())
            assert seen == {"variable": value, "rank": str(rank)}
            assert said is None or f"rank {rank} says hello" in said
