"""The GPU suite's fine-tuning sections: adapters (6) and packing (7); see ``suite.py``."""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch
from measure import peak_mb, reset_memory, timed_steps

ADAPTER_MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"lora_rank": 16},
    "qlora": {"lora_rank": 16, "quantize_base": "nf4"},
}
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip
LLAMA_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def adapters_section(dry: bool) -> dict[str, Any]:
    """A Hugging Face Llama of 1.1B (tiny in a dry run), bf16, one sequence of 1024 tokens:
    tokens/s and peak memory of full fine-tuning, LoRA and QLoRA (rank 16, every linear layer),
    each against full fine-tuning (the target: LoRA >= 1.2x the tokens/s, <= 0.45x the
    memory). QLoRA's row is skipped, with the reason, where torchao is not installed."""
    import importlib.util

    import transformers

    from rapidformer import RapidformerConfig, RapidformerEngine
    from rapidformer.step_io import StepFunctions

    shape, seq, steps = (LLAMA_TINY, 64, 2) if dry else (LLAMA_1B, 1024, 10)
    config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=seq, **shape)
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for mode, flags in ADAPTER_MODES.items():
        if "quantize_base" in flags and importlib.util.find_spec("torchao") is None:
            skipped[mode] = "torchao is not installed here"
            continue
        options = {"lr": 1e-4, "precision": "bf16", "log_interval": 10**9, **flags}
        engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
        reset_memory(engine.device)
        torch.manual_seed(0)
        state = engine.compose(transformers.LlamaForCausalLM(config))
        ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(engine.device)
        functions = StepFunctions(
            train_step=lambda b, m=state.model: m(input_ids=b, labels=b).loss,
            weight=lambda b: b.numel(),
        )
        elapsed, loss = timed_steps(engine, ids, functions, steps)
        trainable = sum(p.numel() for p in state.parameters if p.requires_grad)
        rows[mode] = {
            "tokens_per_s": seq * steps / elapsed,
            "peak_memory_mb": peak_mb(engine.device),
            "trainable": trainable,
            "loss": float(loss),
        }
        engine.close()
        del state, functions, ids, loss  # the next mode's peak must not hold this one's
        gc.collect()
    for values in rows.values():
        values["speed_vs_full"] = values["tokens_per_s"] / rows["full"]["tokens_per_s"]
        values["memory_vs_full"] = values["peak_memory_mb"] / rows["full"]["peak_memory_mb"]
    return {"shape": shape, "seq": seq, "rows": rows, "skipped_rows": skipped}


# ---- 7. packing ---------------------------------------------------------------------------
def packing_section(dry: bool) -> dict[str, Any]:
    """``benchmarks/packing.py``'s three modes (padded to the longest, dynamic-shape buckets,
    packed) on the Llama of 1.1B (tiny and fp32 in a dry run), bf16, one epoch each from the same
    weights, in 2 data orders: learned tokens/s (medians) and each against padded and buckets
    (the targets: packed >= 2x padded, >= 1.3x buckets), peak memory, eval loss (mean)."""
    import packing_epoch as packing
    import transformers

    count, shape, orders = (32, LLAMA_TINY, 1) if dry else (1024, LLAMA_1B, 2)
    # A dry run's CPU may have no bf16 units (20x slower than fp32 there): the code paths in
    # fp32, the GPU's numbers in bf16.
    precision = "fp32" if dry else "bf16"
    config = transformers.LlamaConfig(
        vocab_size=packing.VOCAB, max_position_embeddings=packing.SEQ, **shape
    )
    samples, held_out = packing.corpus(count), packing.corpus(packing.HELD_OUT, seed=1)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in packing.MODES}
    for seed in range(orders):
        for mode in packing.MODES:
            result = packing.train_epoch(
                packing.batches(mode, samples, seed), samples, held_out,
                lambda: transformers.LlamaForCausalLM(config), {"precision": precision},
                on_start=reset_memory, per_sample_attention=mode == "packed",
            )  # fmt: skip
            result["peak_memory_mb"] = peak_mb(result.pop("device"))
            runs[mode].append(result)
            gc.collect()
    rows = {
        mode: {
            "learned_tokens_per_s": statistics.median(r["learned_tokens_per_s"] for r in rs),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in rs),
            "eval_loss": statistics.mean(r["eval_loss"] for r in rs),
            "padding": rs[0]["padding"],
        }
        for mode, rs in runs.items()
    }
    speed = rows["packed"]["learned_tokens_per_s"]
    for row in rows.values():
        row["packed_vs_this"] = speed / row["learned_tokens_per_s"]
    return {"shape": shape, "samples": count, "orders": orders, "rows": rows}
