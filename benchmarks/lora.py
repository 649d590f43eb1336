"""Full fine-tuning, LoRA and QLoRA side by side: peak memory of a step, tokens/s, checkpoint size.

A Llama-shaped model of 124M parameters (hidden 768, 12 layers, 12 heads with 4 key-value
heads, SwiGLU 2048, vocabulary 32,000), one sequence of 512 tokens per step, ``--precision
bf16`` (autocast; weights stored fp32 except QLoRA's NF4 and bf16 base), AdamW, through the
engine. Each mode runs in its own process with ``MALLOC_MMAP_THRESHOLD_`` low (freed buffers
leave the resident set): two warm-up steps (the optimizer's state exists afterwards), then the
peak resident set is reset (``/proc/self/clear_refs``) and three steps are timed. The peak of a
step is that peak minus the resident set before the model was built: everything the run holds
(weights, gradients, optimizer state, activations). LoRA and QLoRA: rank 8, alpha 16, every
linear layer but the head. Checkpoint size: the model's safetensors (full) against the
adapter's ``adapter_model.safetensors``.

    .venv/bin/python benchmarks/lora.py            # full run, writes result files
    .venv/bin/python benchmarks/lora.py --quick    # a 2-layer hidden-384 model, writes nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from activation_memory import peak_rss_kib, rss_kib

RESULT_PREFIX = "RESULT "
MODES = ("full", "lora", "qlora")
FLAGS: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"lora_rank": 8},
    "qlora": {"lora_rank": 8, "quantize_base": "nf4"},
}
SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12}
QUICK_SHAPE = {"hidden_size": 384, "intermediate_size": 512, "num_hidden_layers": 2}
SEQ, WARMUP, TIMED = 512, 2, 3


def child(mode: str, shape: dict[str, int]) -> None:
    import transformers

    from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions
    from rapidformer.accel.lora.saving import save_run_adapter

    torch.manual_seed(0)
    baseline = rss_kib()
    config = transformers.LlamaConfig(
        vocab_size=32000, num_attention_heads=12, num_key_value_heads=4,
        max_position_embeddings=1024, **shape,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    options = {"lr": 1e-4, "precision": "bf16", **FLAGS[mode]}
    engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
    state = engine.compose(model)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return state.model(input_ids=ids, labels=ids).loss

    step = StepFunctions(train_step=loss, weight=lambda ids: ids.numel())
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32000, (1, SEQ), generator=generator) for _ in range(5)]
    losses = [engine.run_step([batches[i]], step).loss for i in range(WARMUP)]
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    started = time.perf_counter()
    losses += [engine.run_step([batches[WARMUP + i]], step).loss for i in range(TIMED)]
    seconds = (time.perf_counter() - started) / TIMED
    peak = peak_rss_kib()
    with tempfile.TemporaryDirectory() as out:
        if state.frozen_base is not None:
            full_state = state.unwrapped_model.state_dict()
            save_run_adapter(state.frozen_base, full_state, out)
            size = (Path(out) / "adapter_model.safetensors").stat().st_size
        else:
            from safetensors.torch import save_file

            save_file(dict(state.unwrapped_model.state_dict()), Path(out) / "model.safetensors")
            size = (Path(out) / "model.safetensors").stat().st_size
    trainable = sum(p.numel() for p in state.unwrapped_model.parameters() if p.requires_grad)
    result = {
        "mode": mode,
        "parameters": parameters,
        "trainable": trainable,
        "peak_mib": (peak - baseline) / 1024,
        "seconds_per_step": seconds,
        "tokens_per_s": SEQ / seconds,
        "checkpoint_bytes": size,
        "losses": losses,
    }
    engine.close()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    from activation_memory import run_script_child
    from common import argument_parser, stamp, write_results

    parser = argument_parser(__doc__ or "", quick="a 2-layer hidden-384 model, 1 run each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=json.dumps(SHAPE), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, json.loads(args.shape))
        return
    shape, repeats = (QUICK_SHAPE, 1) if args.quick else (SHAPE, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES:  # interleaved
            run = run_script_child(__file__, "--child", mode, "--shape", json.dumps(shape))
            runs[mode].append(run)
            print(
                f"run {repeat + 1}/{repeats} {mode:5s} peak {run['peak_mib']:7.1f} MiB, "
                f"{run['tokens_per_s']:7.1f} tokens/s, checkpoint "
                f"{run['checkpoint_bytes'] / 2**20:.1f} MiB, losses {run['losses'][0]:.4f}",
                flush=True,
            )
    summary = {
        mode: {
            "peak_mib": statistics.median(r["peak_mib"] for r in rs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "checkpoint_mib": rs[0]["checkpoint_bytes"] / 2**20,
            "trainable": rs[0]["trainable"],
            "parameters": rs[0]["parameters"],
        }
        for mode, rs in runs.items()
    }
    full = summary["full"]
    ratios = {
        mode: {
            "memory": s["peak_mib"] / full["peak_mib"],
            "speed": s["tokens_per_s"] / full["tokens_per_s"],
            "checkpoint": s["checkpoint_mib"] / full["checkpoint_mib"],
        }
        for mode, s in summary.items()
    }
    for mode, ratio in ratios.items():
        print(f"{mode:5s} / full: memory {ratio['memory']:.3f}, tokens/s {ratio['speed']:.2f}, "
              f"checkpoint {ratio['checkpoint']:.4f}")  # fmt: skip
    if args.quick:
        return
    result = stamp(
        {"shape": shape, "seq": SEQ, "repeats": repeats, "summary": summary, "ratios": ratios,
         "runs": runs}
    )  # fmt: skip
    rows = [
        f"| {mode} | {s['trainable']:,} | {s['peak_mib']:.0f} ({ratios[mode]['memory']:.2f}x) | "
        f"{s['tokens_per_s']:.0f} ({ratios[mode]['speed']:.2f}x) | "
        f"{s['checkpoint_mib']:.1f} ({100 * ratios[mode]['checkpoint']:.2f}%) |"
        for mode, s in summary.items()
    ]
    write_results("lora", result, [
        "# Full fine-tuning, LoRA and QLoRA",
        "",
        f"A Llama-shaped model of {full['parameters'] / 1e6:.0f}M parameters, one sequence of "
        f"{SEQ} tokens per step, bf16 autocast, AdamW, on the CPU; each mode in its own "
        f"process, {repeats} interleaved runs, medians. Peak: the resident set's peak during "
        f"{TIMED} steps (after {WARMUP} warm-up steps) minus the resident set before the model "
        "was built. Adapters: rank 8, alpha 16, every linear layer but the head.",
        "",
        "| mode | trained parameters | peak of a step, MiB (x full) | tokens/s (x full) | "
        "checkpoint, MiB (% of full) |",
        "|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


if __name__ == "__main__":
    main()
