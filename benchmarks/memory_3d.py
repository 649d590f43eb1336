"""Per-rank memory of GPT 1.3B under tensor x pipeline parallelism and ZeRO: the model state
computed by the real parallelisation code on the meta device, the dry run's whole estimate
(``rapidformer --dry-run``: model state, buffers, activations), and the reference tool's
published peak memory per GPU.

The model is the reference tool's GPT 1.3B (24 layers, hidden 2048, 32 heads, sequence 1024,
vocabulary 50304, tied embeddings), trained with fp16 mixed-precision Adam: 16 bytes per
parameter a rank holds (fp16 weight 2 + fp16 gradient 2 + fp32 master weight 4 + two fp32 Adam
moments 8; the ZeRO paper's accounting). For every layout tp x pp = 1x1, 2x1, 4x1, 1x2, 1x4,
2x2, 4x4, each rank of a simulated world (torch's fake process group: no communication, no
memory) builds the model on the meta device and runs rapidformer's own pipeline cut and tensor
parallel plan (``apply_pipeline``, ``apply_tensor_parallel``); the parameters it then holds
(local DTensor shards, its stages only) are counted. The largest rank is reported, with the
formula ``16 P / (tp x pp)`` (perfect split) and the published peak memory, which also holds
activations, buffers and the allocator's slack.

The dry run then estimates each layout's worst rank whole, with the reference benchmark's
settings (fp16 mixed precision, micro-batch 1, global batch 4, sequence 1024, one rank per
tp x pp position); and the reference's data-parallel rows (fp16, OSS, OSS/SDP, ZeRO-1, ZeRO-2;
4 ranks, 4 GPUs of a node) the same way. Its estimate excludes the CUDA context and the
allocator's slack, which the published peaks include.

    .venv/bin/python benchmarks/memory_3d.py          # full grid, writes result files
    .venv/bin/python benchmarks/memory_3d.py --quick  # 2 layouts of a small GPT; writes nothing
"""

from __future__ import annotations

import torch
from common import argument_parser, stamp, write_results

from rapidformer import RapidformerConfig
from rapidformer.accel.pipeline.schedule import apply_pipeline
from rapidformer.accel.tensor_parallel import apply_tensor_parallel
from rapidformer.distributed import ParallelDims, ParallelMesh
from rapidformer.dryrun import dry_run, gpt_workload
from rapidformer.dryrun.simulate import fake_world
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step.optimizer_step import TorchStepper

BYTES_PER_PARAMETER = 16  # fp16 mixed-precision Adam
GPT_1_3B = GPTConfig(
    vocab_size=50304,
    num_layers=24,
    hidden_size=2048,
    num_attention_heads=32,
    max_position_embeddings=1024,
)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (4, 4)]
PUBLISHED_MB = {  # shared/REFERENCE.md: peak memory per GPU, MB
    (1, 1): 25061,
    (2, 1): 11300,
    (4, 1): 5673,
    (1, 2): 12375,
    (1, 4): 8141,
    (2, 2): 6211,
    (4, 4): 5673,
}


def held_parameters(model: GPTConfig, tp: int, pp: int, rank: int) -> int:
    """Elements of the parameters ``rank`` of a tp x pp world holds."""
    world = tp * pp
    with fake_world(world, rank):  # torch's fake process group (any existing one set aside)
        dims = ParallelDims(world_size=world, tp=tp, pp=pp, rank=rank)
        mesh = ParallelMesh.build(dims, "cpu")
        config = RapidformerConfig.from_dict(
            {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "micro_batch_size": 1,
                "global_batch_size": 4,  # the reference benchmark's batch sizes
            }
        )
        gpt = GPTModel.build(model, "meta")
        state = TrainState(
            model=gpt,
            device=torch.device("cpu"),
            mesh=mesh,
            forward_backward=EagerForwardBackward(),
            stepper=TorchStepper(0.0),
        )
        state = apply_tensor_parallel(apply_pipeline(state, config, mesh), config, mesh)
        seen: set[int] = set()
        total = 0
        for part in state.model_parts:
            for param in part.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    local = param.to_local() if hasattr(param, "to_local") else param
                    total += local.numel()
        return total


DATA_PARALLEL_ROWS: dict[str, tuple[dict[str, object], int]] = {  # flags, published MB
    "fp16": ({}, 25061),
    "+ OSS": ({"oss_memory_optimization": True}, 22077),
    "+ OSS/SDP": ({"oss_sdp_memory_optimization": True}, 17113),
    "+ ZeRO-1": ({"zero_1_memory_optimization": True, "zero_backend": "deepspeed"}, 15709),
    "+ ZeRO-2": ({"zero_2_memory_optimization": True, "zero_backend": "deepspeed"}, 15693),
}
"""The reference's GPT 1.3B rows on 4 GPUs (shared/REFERENCE.md)."""


def dry_run_total(model: GPTConfig, world: int, flags: dict[str, object]) -> dict[str, float]:
    """The dry run's worst rank (MiB) for the reference's settings plus ``flags``."""
    config = RapidformerConfig.from_dict(
        {"micro_batch_size": 1, "global_batch_size": 4, "mixed_precision": True, "lr": 1e-4,
         "train_iters": 1, "seq_length": model.max_position_embeddings, **flags}
    )  # fmt: skip
    worst = dry_run(config, world, gpt_workload(model, 1), "GPT 1.3B").worst
    return {
        "dry_run_total_mib": round(worst.total / 2**20, 1),
        "dry_run_state_mib": round(worst.device_state / 2**20, 1),
        "dry_run_buffers_mib": round(worst.buffers / 2**20, 1),
        "dry_run_activations_mib": round(worst.activations / 2**20, 1),
    }


def main() -> None:
    parser = argument_parser(__doc__, "a 4-layer GPT at 1x1 and 2x2")
    args = parser.parse_args()
    model, layouts = GPT_1_3B, LAYOUTS
    if args.quick:
        model = GPTConfig(
            vocab_size=512,
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
        layouts = [(1, 1), (2, 2)]
    whole = held_parameters(model, 1, 1, 0)
    rows = []
    for tp, pp in layouts:
        per_rank = [held_parameters(model, tp, pp, r) for r in range(tp * pp)]
        largest = max(per_rank) * BYTES_PER_PARAMETER / 2**20
        formula = whole * BYTES_PER_PARAMETER / (tp * pp) / 2**20
        published = PUBLISHED_MB.get((tp, pp))
        estimate = dry_run_total(
            model,
            tp * pp,
            {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        )
        rows.append(
            {
                "tp": tp,
                "pp": pp,
                **estimate,
                "dry_run_over_published": round(estimate["dry_run_total_mib"] / published, 3)
                if published
                else None,
                "largest_rank_mib": round(largest, 1),
                "smallest_rank_mib": round(min(per_rank) * BYTES_PER_PARAMETER / 2**20, 1),
                "formula_mib": round(formula, 1),
                "measured_over_formula": round(largest / formula, 3),
                "published_peak_mb": published,
                "measured_over_published": round(largest / published, 3) if published else None,
            }
        )
        print(rows[-1], flush=True)
    data_parallel = []
    for name, (flags, published_mb) in DATA_PARALLEL_ROWS.items():
        estimate = dry_run_total(model, 4, flags)
        ratio = round(estimate["dry_run_total_mib"] / published_mb, 3)
        data_parallel.append(
            {"row": name, **estimate, "published_peak_mb": published_mb,
             "dry_run_over_published": ratio}
        )  # fmt: skip
        print(data_parallel[-1], flush=True)
    if args.quick:
        return
    result = stamp(
        {
            "model": "GPT 1.3B: 24 layers, hidden 2048, 32 heads, seq 1024, vocab 50304",
            "parameters": whole,
            "bytes_per_parameter": BYTES_PER_PARAMETER,
            "rows": rows,
            "data_parallel_rows": data_parallel,
        }
    )
    lines = [
        "# Memory per rank under tensor x pipeline parallelism and ZeRO (GPT 1.3B)",
        "",
        f"{whole:,} parameters, {BYTES_PER_PARAMETER} bytes each (fp16 mixed-precision Adam). "
        "Measured: the largest rank's parameters after rapidformer's own pipeline cut and "
        "tensor-parallel plan on the meta device (fake process group). Published: the "
        "reference tool's peak memory per GPU (activations included).",
        "",
        "| tp x pp | largest rank MiB | smallest rank MiB | formula 16P/(tp*pp) MiB "
        "| measured / formula | published peak MB | measured / published |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tp']}x{row['pp']} | {row['largest_rank_mib']:,} | "
            f"{row['smallest_rank_mib']:,} | {row['formula_mib']:,} | "
            f"{row['measured_over_formula']} | {row['published_peak_mb']:,} | "
            f"{row['measured_over_published']} |"
        )
    lines += [
        "",
        "## The dry run of the reference's benchmark",
        "",
        "`rapidformer --dry-run` of each row with the reference's settings (fp16, micro-batch 1, "
        "global batch 4, seq 1024): the worst rank's model state, buffers (FSDP's gathered "
        "parameters; DDP's buckets are the gradients, in the state) and activations (the "
        "pipeline's in-flight micro-batches included), beside the published peak. The "
        "published peaks also hold the CUDA context and the allocator's slack; the DeepSpeed "
        "rows are estimated with the native layout of their stage.",
        "",
        "| layout | ranks | state MiB | buffers MiB | activations MiB | dry-run total MiB "
        "| published peak MB | dry run / published |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| tp {row['tp']} x pp {row['pp']} | {row['tp'] * row['pp']} "
            f"| {row['dry_run_state_mib']:,} | {row['dry_run_buffers_mib']:,} "
            f"| {row['dry_run_activations_mib']:,} | {row['dry_run_total_mib']:,} "
            f"| {row['published_peak_mb']:,} | {row['dry_run_over_published']} |"
        )
    for row in data_parallel:
        lines.append(
            f"| dp 4, {row['row']} | 4 | {row['dry_run_state_mib']:,} "
            f"| {row['dry_run_buffers_mib']:,} | {row['dry_run_activations_mib']:,} "
            f"| {row['dry_run_total_mib']:,} | {row['published_peak_mb']:,} "
            f"| {row['dry_run_over_published']} |"
        )
    write_results("memory_3d", result, lines)


if __name__ == "__main__":
    main()
