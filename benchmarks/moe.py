"""Dense GPT against an MoE GPT with the same active parameters per token, and the two expert
kernels.

Both models are the built-in GPT (4 layers, hidden 128, vocabulary 256, sequences of 64) run
through the engine on one process with the same seed, data and steps (AdamW 1e-3, clipping 1).
The dense FFN is 128 -> 512 -> 128; the MoE model has 8 experts of 128 -> 256 -> 128 in every
layer, top-2, so each token goes through 2 x 256 = 512 FFN units, as in the dense model, with
4x the FFN parameters (dropless, aux loss 1e-2). Reported: each model's final loss (mean of
the last 20 steps), tokens/s, and their ratio. Then one MoE layer's expert computation
(forward + backward of 2048 routed rows) on ``torch._grouped_mm`` against the per-expert loop.

    .venv/bin/python benchmarks/moe.py          # 150 steps each, writes the result files
    .venv/bin/python benchmarks/moe.py --quick  # 10 steps, writes nothing
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import argument_parser, stamp, write_results

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.models.moe import GroupedExperts
from rapidformer.step_io import StepFunctions
from rapidformer.testing import MarkovLMDataset, lm_tokens, pad_collate

SEQ, BATCH, EXPERTS, TOPK = 64, 16, 8, 2
DENSE = GPTConfig(
    vocab_size=256,
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    max_position_embeddings=SEQ,
    ffn_hidden_size=512,
    dropout=0.0,
)
EXPERT_FFN = 512 // TOPK  # the same FFN width per token as the dense model


def _loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def train(moe: bool, steps: int) -> dict[str, Any]:
    flags: dict[str, Any] = {"micro_batch_size": BATCH, "lr": 1e-3, "clip_grad": 1.0, "seed": 5}
    if moe:
        flags.update(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN)
    engine = RapidformerEngine(RapidformerConfig.from_dict(flags), builds_optimizer=True)
    state = engine.compose(GPTModel.build(DENSE, "meta", seed=5))
    data = MarkovLMDataset(BATCH * steps, vocab_size=256, min_length=SEQ, max_length=SEQ, seed=3)
    batches = [
        pad_collate([data[i] for i in range(s * BATCH, (s + 1) * BATCH)], SEQ) for s in range(steps)
    ]
    step = StepFunctions(
        train_step=lambda b: _loss(state.model(b["input_ids"]), b), weight=lm_tokens
    )
    losses, times = [], []
    for batch in batches:
        start = time.perf_counter()
        losses.append(engine.run_step([batch], step).loss)
        times.append(time.perf_counter() - start)
    timed = times[5:] if len(times) > 10 else times  # the first steps warm caches up
    active = sum(p.numel() for n, p in state.unwrapped_model.named_parameters())
    routing = engine.routing_metrics()
    return {
        "model": "moe" if moe else "dense",
        "parameters": active,
        "final_loss": round(statistics.mean(losses[-20:]), 4),
        "tokens_per_s": round(BATCH * SEQ / statistics.median(timed), 1),
        "step_ms": round(1000 * statistics.median(timed), 2),
        **({"moe_load_imbalance": round(routing["moe_load_imbalance"], 3)} if moe else {}),
    }


def expert_kernels(repeats: int) -> list[dict[str, Any]]:
    """Forward + backward of the experts of one layer over 2048 routed rows."""
    generator = torch.Generator().manual_seed(0)
    rows = BATCH * SEQ * TOPK
    counts = torch.multinomial(torch.ones(EXPERTS), rows, replacement=True, generator=generator)
    counts = torch.bincount(counts, minlength=EXPERTS)
    x = torch.randn(rows, DENSE.hidden_size, generator=generator)
    out = []
    for kernel in ("grouped_mm", "loop"):
        experts = GroupedExperts(EXPERTS, DENSE.hidden_size, EXPERT_FFN, "tanh")
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0.0, 0.02, generator=generator)
        experts.force_loop = kernel == "loop"
        assert experts.kernel(torch.float32, torch.device("cpu")) == kernel
        times = []
        for _ in range(repeats):
            inputs = x.clone().requires_grad_()
            start = time.perf_counter()
            experts(inputs, counts).sum().backward()
            times.append(time.perf_counter() - start)
        out.append({"kernel": kernel, "ms": round(1000 * statistics.median(times[3:]), 3)})
    return out


def main() -> None:
    args = argument_parser(__doc__, "10 steps each").parse_args()
    steps = 10 if args.quick else 150
    torch.manual_seed(0)
    dense, moe = train(False, steps), train(True, steps)
    kernels = expert_kernels(10 if args.quick else 60)
    ratio = round(moe["tokens_per_s"] / dense["tokens_per_s"], 3)
    speedup = round(kernels[1]["ms"] / kernels[0]["ms"], 2)
    for row in (dense, moe, *kernels):
        print(row)
    print(f"MoE / dense tokens/s: {ratio}; grouped_mm is {speedup}x the loop")
    if args.quick:
        return
    result = stamp(
        {
            "dense": dense,
            "moe": moe,
            "moe_over_dense_tokens_per_s": ratio,
            "kernels": kernels,
            "grouped_mm_speedup": speedup,
            "shape": dataclasses.asdict(DENSE)
            | {"experts": EXPERTS, "topk": TOPK, "expert_ffn": EXPERT_FFN, "steps": steps},
        }
    )
    lines = [
        "# MoE GPT vs dense GPT, same active parameters per token",
        "",
        f"Built-in GPT, {DENSE.num_layers} layers, hidden {DENSE.hidden_size}, sequences of "
        f"{SEQ}, batch {BATCH}, {steps} steps each on the same data (one process, fp32). "
        f"Dense FFN {DENSE.hidden_size} -> 512; MoE: {EXPERTS} experts of "
        f"{DENSE.hidden_size} -> {EXPERT_FFN}, top-{TOPK}, dropless, aux loss 1e-2.",
        "",
        "| model | parameters | final loss (last 20 steps) | tokens/s | step ms |",
        "|---|---|---|---|---|",
    ]
    for row in (dense, moe):
        lines.append(
            f"| {row['model']} | {row['parameters']:,} | {row['final_loss']} | "
            f"{row['tokens_per_s']} | {row['step_ms']} |"
        )
    lines += [
        "",
        f"MoE / dense tokens/s: **{ratio}**. Load imbalance at the end (max / mean assignments "
        f"per expert, worst layer): {moe['moe_load_imbalance']}.",
        "",
        f"Expert computation of one layer, forward + backward of {BATCH * SEQ * TOPK} routed rows:",
        "",
        "| kernel | ms |",
        "|---|---|",
        *(f"| {k['kernel']} | {k['ms']} |" for k in kernels),
        "",
        f"torch._grouped_mm is **{speedup}x** the per-expert loop.",
    ]
    write_results("moe", result, lines)


if __name__ == "__main__":
    sys.exit(main())
