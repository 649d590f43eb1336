"""Two "nodes" on this machine: two torchrun agents of one process each, meeting through
torchrun's c10d rendezvous on 127.0.0.1 (``--nnodes 2``), as two machines would. DDP and
ZeRO-2 must reproduce the one-process run (docs/cli.md, "Beyond one machine")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses, tiny_trainer

TOLERANCE = 1e-5  # fp32, the same global batches: max |loss difference| over the steps
RUN = ["--train-iters", "8", "--global-batch-size", "8", "--eval-interval", "4"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _two_nodes(save: Path, extra: list[str]) -> list[str]:
    """Start both agents at once (the rendezvous waits for the second), wait for both, and
    return their stderr."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(2):
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
            *("--nproc_per_node", "1", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}"),
            *("--max-restarts", "0", "--local-addr", "127.0.0.1"),
            *("-m", "rapidformer", "--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS),
            *(*RUN, "--micro-batch-size", "2", "--save", str(save), *extra),
        ]
        log = open(save.parent / f"{save.name}-node{node}.log", "w+")  # noqa: SIM115
        agents.append((subprocess.Popen(command, stderr=log, stdout=log, env=env), log))
    outputs = []
    for agent, log in agents:
        code = agent.wait(timeout=300)
        log.seek(0)
        text = log.read()
        log.close()
        assert code == 0, text[-3000:]
        outputs.append(text)
    return outputs


@pytest.mark.distributed
def test_two_nodes_through_c10d_rendezvous_match_one_process(tmp_path: Path) -> None:
    single = tmp_path / "single"
    tiny_trainer(*RUN, "--micro-batch-size", "8", "--save", str(single)).fit()
    reference = read_losses(single)
    gaps = {}
    for name, extra, plan in (
        ("ddp", [], "data parallel: torch DistributedDataParallel (2 ranks, gloo"),
        ("zero2", ["--zero-2-memory-optimization"], "ZeRO-2 (native)"),
    ):
        logs = _two_nodes(tmp_path / name, extra)
        assert plan in "".join(logs)  # rank 0 (on one of the nodes) logged the plan
        losses = read_losses(tmp_path / name)
        assert sorted(losses) == list(range(1, 9))
        gaps[name] = max(abs(reference[s] - losses[s]) for s in reference)
    print(f"two nodes vs one process, max loss gap: {gaps}")
    assert all(gap <= TOLERANCE for gap in gaps.values()), gaps
    assert reference[8] < reference[1] - 0.2  # it trained
