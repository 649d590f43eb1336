"""Measured bubble fraction of each pipeline schedule next to the theory.

Stages whose forward and backward take fixed, known times (sleeps, so two shared CPU cores do
not matter): each rank's forward work per micro-batch is F = 20 ms and its backward B = 40 ms,
split evenly over its virtual stages, and the backward is half input gradient, half weight
gradient (what ZBV schedules separately). A step of m micro-batches then needs m (F + B) of
work per rank; the bubble is what the step's wall time adds: ``1 - m (F + B) / T``. Theory:
``(p - 1) / (v m + p - 1)`` (v = 1 for 1F1B and GPipe; the interleaved and ZBV schedules run
v = 2 stages per rank; for ZBV it is an upper bound). The stages, placement and schedules are
rapidformer's pipeline layout and torch.distributed.pipelining's schedules, on gloo ranks.

    .venv/bin/python benchmarks/pipeline_bubble.py          # p = 2, 4; m = 4, 8, 16
    .venv/bin/python benchmarks/pipeline_bubble.py --quick  # p = 2, m = 4; writes nothing
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import argument_parser, stamp, write_results
from torch import nn
from torch.distributed.pipelining import PipelineStage

from rapidformer.accel.pipeline.layout import StageLayout
from rapidformer.accel.pipeline.schedule import _SCHEDULES
from rapidformer.testing import run_distributed

FORWARD_S, BACKWARD_S = 0.020, 0.040
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBV")
HIDDEN = 8


class _InputPath(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` forward and ``backward_s`` for the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """Zeros shaped like ``like``; its weight gradient (zero) takes ``backward_s``."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, like: torch.Tensor, backward_s: float) -> Any:
        ctx.backward_s = backward_s
        ctx.save_for_backward(weight)
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        (weight,) = ctx.saved_tensors
        return torch.zeros_like(weight), None, None


class TimedStage(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HIDDEN))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _InputPath.apply(x, self.forward_s, self.backward_s / 2)
        return y + _WeightPath.apply(self.weight, y.detach(), self.backward_s / 2)


def _measure(schedule_name: str, pp: int, microbatches: int) -> float:
    """Wall seconds of one step (after a warm-up step) of ``schedule_name``."""
    virtual = 2 if schedule_name in ("Interleaved1F1B", "ZBV") else 1
    layout = StageLayout((1,) * (pp * virtual), pp, schedule_name)
    rank = dist.get_rank()
    stages = [
        PipelineStage(
            TimedStage(FORWARD_S / virtual, BACKWARD_S / virtual), s, layout.num_stages, "cpu"
        )
        for s in layout.held(rank)
    ]
    cls = _SCHEDULES[schedule_name]
    schedule = cls(
        stages[0] if virtual == 1 else stages,
        microbatches,
        loss_fn=lambda out, target: (out * out).sum(),  # a contiguous gradient to send
        scale_grads=False,
    )
    x = torch.ones(microbatches, HIDDEN)
    times = []
    for _ in range(2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x, target=x)
        else:
            schedule.step(target=x)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[-1]


def _worker(out: str, microbatch_counts: list[int], schedules: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp = dist.get_world_size()
    rows = []
    for name in schedules:
        for m in microbatch_counts:
            seconds = _measure(name, pp, m)
            virtual = 2 if name in ("Interleaved1F1B", "ZBV") else 1
            theory = StageLayout((1,) * (pp * virtual), pp, name).bubble(m)
            measured = 1 - m * (FORWARD_S + BACKWARD_S) / seconds
            rows.append(
                {
                    "schedule": name,
                    "p": pp,
                    "m": m,
                    "step_s": round(seconds, 4),
                    "measured": round(measured, 4),
                    "theory": round(theory, 4),
                    "measured_over_theory": round(measured / theory, 3),
                }
            )
    if dist.get_rank() == 0:
        Path(out, f"p{pp}.json").write_text(json.dumps(rows))


def main() -> None:
    parser = argument_parser(__doc__, "p = 2, m = 4, every schedule")
    args = parser.parse_args()
    ranks, counts = ([2], [4]) if args.quick else ([2, 4], [4, 8, 16])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as out:
        for pp in ranks:
            run_distributed(_worker, pp, out, counts, list(SCHEDULES))
            rows += json.loads(Path(out, f"p{pp}.json").read_text())
    for row in rows:
        print(row, flush=True)
    if args.quick:
        return
    # No environment in the command: it would record this machine's variables and paths.
    result = stamp({"forward_s": FORWARD_S, "backward_s": BACKWARD_S, "rows": rows})
    lines = [
        "# Pipeline bubble: measured vs theory",
        "",
        f"Per rank and micro-batch: forward {FORWARD_S * 1000:.0f} ms, backward "
        f"{BACKWARD_S * 1000:.0f} ms (sleeps). Measured bubble = 1 - m (F + B) / step time.",
        "",
        "| schedule | p | m | step s | measured | theory | measured / theory |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['step_s']} | {r['measured']:.3f} | "
            f"{r['theory']:.3f} | {r['measured_over_theory']} |"
        )
    write_results("pipeline_bubble", result, lines)


if __name__ == "__main__":
    sys.exit(main())
