"""Per-rank model-state bytes and step time of DDP, OSS (ZeRO-1), SDP (ZeRO-2), FSDP
(ZeRO-3) and DeepSpeed ZeRO-1/2/3, at 2 and 4 ranks, next to the ZeRO paper's formulas.

A ~100M-parameter built-in GPT (10 layers, hidden 768, vocabulary 32000, tied embeddings) takes
a few fp32 AdamW steps on CPU ranks (gloo). Each rank counts the bytes of the parameters,
gradients and optimizer state it holds from the tensors themselves (a DTensor counts its local
shard, ZeroRedundancyOptimizer only its partition's state). The ZeRO paper's formulas per
parameter, for fp32 Adam (4 bytes weights, 4 gradients, 8 moments): DDP 16, ZeRO-1 8 + 8/N,
ZeRO-2 4 + 12/N, ZeRO-3 16/N (its mixed-precision figures, 16, 4 + 12/N, 2 + 14/N and 16/N, add
an fp16 copy of weights and gradients that fp32 training does not have). Step times are
medians after one warm-up step, as a ratio to DDP at the same rank count.

    .venv/bin/python benchmarks/memory.py           # full run, writes result files
    .venv/bin/python benchmarks/memory.py --quick   # tiny model, 2 ranks; writes nothing
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import argument_parser, stamp, write_results

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.accel.deepspeed.state import held_state_bytes
from rapidformer.memory import StateBytes, measured_bytes
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.testing import run_distributed

MODES = {  # row -> (flag, ZeRO stage whose formula applies, backend)
    "DDP": (None, 0, "native"),
    "OSS (ZeRO-1)": ("oss_memory_optimization", 1, "native"),
    "SDP (ZeRO-2)": ("oss_sdp_memory_optimization", 2, "native"),
    "FSDP (ZeRO-3)": ("fsdp_memory_optimization", 3, "native"),
    "DeepSpeed ZeRO-1": ("zero_1_memory_optimization", 1, "deepspeed"),
    "DeepSpeed ZeRO-2": ("zero_2_memory_optimization", 2, "deepspeed"),
    "DeepSpeed ZeRO-3": ("zero_3_memory_optimization", 3, "deepspeed"),
}
SEQ, MICRO = 64, 1


def formula(stage: int, n: int) -> float:
    """fp32-Adam bytes per parameter per rank (ZeRO paper, Table 1 with K = 8, no fp16 copy)."""
    return {0: 16.0, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def _held(state: Any, backend: str) -> StateBytes:
    """Bytes this rank holds now: DeepSpeed's partitions, or the native tensors."""
    if backend == "deepspeed":
        return held_state_bytes(state.model)
    return measured_bytes(state.model, state.optimizer)


def _worker(flag: str | None, backend: str, shape: dict[str, int], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    options: dict[str, Any] = {"micro_batch_size": MICRO, "lr": 1e-4, "zero_backend": backend}
    if flag is not None:
        options[flag] = True
    engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
    heads = shape["hidden_size"] // 64
    config = GPTConfig(**shape, num_attention_heads=heads, max_position_embeddings=SEQ, dropout=0.0)
    state = engine.compose(GPTModel.build(config))
    generator = torch.Generator().manual_seed(engine.env.rank)
    times: list[float] = []
    held: dict[str, int] = {}
    for step in range(steps + 1):
        tokens = torch.randint(0, shape["vocab_size"], (MICRO, SEQ + 1), generator=generator)
        start = time.perf_counter()
        logits = state.model(tokens[:, :-1])
        if step == 0:
            # DeepSpeed ZeRO-3 gathers blocks inside its hooks, out of sight here: its row
            # shows the partitions it keeps.
            held["parameters_in_forward"] = _held(state, backend).parameters
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        if step == 0:
            held["gradients"] = _held(state, backend).gradients
        engine.step()
        times.append(time.perf_counter() - start)
        if step == 0:
            after = _held(state, backend)
            held.update(parameters=after.parameters, optimizer=after.optimizer)
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in state.unwrapped_model.parameters())
    record = {"held": held, "step_s": statistics.median(times[1:]), "numel": numel}
    Path(out, f"rank_{engine.env.rank}.json").write_text(json.dumps(record))
    engine.close()


def measure(
    flag: str | None, backend: str, ranks: int, shape: dict[str, int], steps: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        run_distributed(_worker, ranks, flag, backend, shape, steps, out)
        records = [json.loads(Path(out, f"rank_{r}.json").read_text()) for r in range(ranks)]
    kinds = ("parameters", "gradients", "optimizer", "parameters_in_forward")
    return {
        "numel": records[0]["numel"],
        # The most any rank holds (uneven partitions differ by at most one tensor).
        **{kind: max(r["held"][kind] for r in records) for kind in kinds},
        "step_s": statistics.median(r["step_s"] for r in records),
    }


def main() -> None:
    parser = argument_parser(__doc__ or "", "a 4-layer hidden-128 GPT at 2 ranks, 2 steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    args = parser.parse_args()
    if args.quick:
        shape = {"vocab_size": 1000, "num_layers": 4, "hidden_size": 128}
        rank_counts, steps = (2,), 2
    else:
        shape = {"vocab_size": 32000, "num_layers": 10, "hidden_size": 768}
        rank_counts, steps = (2, 4), args.steps
    rows: list[dict[str, Any]] = []
    for ranks in rank_counts:
        for name, (flag, stage, backend) in MODES.items():
            if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                print(f"{name}: skipped, DeepSpeed is not installed", file=sys.stderr)
                continue
            result = measure(flag, backend, ranks, shape, steps)
            rest = result["parameters"] + result["gradients"] + result["optimizer"]
            # ZeRO-2 holds whole parameters from forward to the end of backward.
            working = rest - result["parameters"] + result["parameters_in_forward"]
            per_param = max(rest, working) / result["numel"]
            rows.append(
                dict(
                    result,
                    mode=name,
                    ranks=ranks,
                    bytes_per_param=per_param,
                    formula=formula(stage, ranks),
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    for row in rows:
        ddp = next(r for r in rows if r["ranks"] == row["ranks"] and r["mode"] == "DDP")
        row["step_time_vs_ddp"] = row["step_s"] / ddp["step_s"]
        row["model_state_vs_ddp"] = row["bytes_per_param"] / ddp["bytes_per_param"]
    lines = [
        "# Model-state memory per rank: DDP vs OSS / SDP / FSDP (native ZeRO-1/2/3) vs "
        "DeepSpeed ZeRO-1/2/3",
        "",
        f"GPT {shape['num_layers']} layers, hidden {shape['hidden_size']}, vocabulary "
        f"{shape['vocab_size']} ({rows[0]['numel'] / 1e6:.1f}M parameters), fp32 AdamW, "
        f"micro-batch {MICRO} x {SEQ} tokens, gloo CPU ranks. Bytes counted from the tensors "
        'each rank holds after the first step (the largest rank); "params in fwd/bwd" are '
        "the parameter bytes held between forward and backward; bytes/param counts the larger "
        "of the two parameter figures. Formula: the ZeRO paper's, fp32. DeepSpeed keeps an "
        "fp32 master copy of its partition even for an fp32 model (+4/N bytes per parameter; "
        "at stage 3 that is the only fp32 copy besides the partitioned module parameters), "
        "and at stage 1 it reduces the step's gradients into partitions like stage 2.",
        "",
        "| ranks | mode | params MiB | grads MiB | optimizer MiB | params in fwd/bwd MiB "
        "| bytes/param | formula | measured/formula | vs DDP | step time vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['mode']} | {r['parameters'] / mib:.0f} | "
            f"{r['gradients'] / mib:.0f} | {r['optimizer'] / mib:.0f} | "
            f"{r['parameters_in_forward'] / mib:.0f} | {r['bytes_per_param']:.2f} | "
            f"{r['formula']:.2f} | {r['bytes_per_param'] / r['formula']:.3f} | "
            f"{r['model_state_vs_ddp']:.3f} | {r['step_time_vs_ddp']:.2f} |"
        )
    print("\n".join(lines))
    if args.quick:
        return
    result = stamp({"shape": shape, "seq": SEQ, "micro": MICRO, "steps": steps, "rows": rows})
    write_results("memory", result, lines)


if __name__ == "__main__":
    main()
