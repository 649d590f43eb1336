"""The GPU suite: every figure docs/benchmarks.md waits for, in one run of a few minutes.

Sections (each timed, each failing on its own without stopping the others):

1. ``precision``: BERT-base (12 layers, hidden 768) pretraining-shaped MLM steps in fp32, fp16
   and bf16: samples/s, ratio to fp32, peak memory (the reference tool's table; its anchor:
   1.73x for mixed precision).
2. ``throughput``: GPT-350M, GPT-1.3B and a Hugging Face Llama of 1.2B, bf16, fused AdamW, at
   sequence length 1024, eager, compiled per block and compiled whole: each row the engine
   beside a hand-written loop of the same model in the same process, interleaved, 20 timed
   steps x 3 repeats after warm-up, with the median engine / hand ratio and its spread, MFU,
   peak memory, and the compiled graphs and eager fallbacks (``side_by_side.py``).
   ``recompute``: GPT-1.3B eager, tokens/s and peak memory with no recomputation, full,
   selective, and full recomputation of half the layers (``--recompute-method block``), each
   beside the dry run's estimate of that peak (``rapidformer --dry-run``; estimate / measured).
3. ``optimizers``: one ``optimizer.step()`` over GPT-350M's parameters: fused AdamW vs LAMB
   (multi-tensor, and through ``torch.compile`` as rapidformer runs it on CUDA).
4. ``dynamic_shape``: fixed vs dynamic-shape batches on a length-skewed corpus: tokens/s.
5. ``onnxruntime``: a training step with ONNX Runtime (CUDA execution provider where the
   installed build has it) vs eager; skipped, with the reason, where it is not installed.
6. ``adapters``: a Hugging Face Llama of 1.1B, bf16, 1024 tokens: full fine-tuning, LoRA and
   QLoRA (rank 16), tokens/s and peak memory against full fine-tuning (QLoRA needs torchao,
   which the GPU image lacks unless its wheel is carried).
7. ``packing``: the same Llama, bf16, one epoch over long-tailed samples padded to the longest,
   in dynamic-shape buckets and packed (``benchmarks/packing.py``'s modes): learned tokens/s,
   peak memory, eval loss.

8. ``async_save``: the built-in GPT of about 300M parameters, fp32, AdamW: synchronous
   checkpoints against ``--async-save``'s writer (the copy goes to pinned host memory), each
   mode's training stall per save, step time while a write runs, and whether the end states
   agree (``benchmarks/async_save.py``'s measurement).

Sections 6 and 7 are in ``finetuning.py``.

``--dry-run`` runs the same code on tiny shapes (on a CPU in under two minutes); CI runs it so
the suite never rots. Writes ``gpu_suite.json`` and ``gpu_suite.md`` to ``--out``; compile
caches belong outside it (``run.sh`` puts them under the temporary directory).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the benchmarks' shared modules

from common import footer, stamp  # noqa: E402
from finetuning import adapters_section, packing_section  # noqa: E402
from measure import peak_mb, reset_memory, sync, timed_steps  # noqa: E402

from rapidformer.models.gpt import GPTConfig, GPTModel  # noqa: E402


# ---- 1. precision ------------------------------------------------------------------------
def precision_section(dry: bool) -> dict[str, Any]:
    import precision

    shape = dict(precision.QUICK) if dry else {**precision.SHAPES["bert"], "layers": 12}
    batch, seq, steps = (4, 32, 2) if dry else (32, 128, 10)
    rows = {}
    for name in precision.PRECISIONS:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        reset_memory(device)
        run = precision.run_one("bert", name, shape, steps, batch, seq)
        rows[name] = {
            "samples_per_s": batch / statistics.median(run["step_s"]),
            "peak_memory_mb": run["peak_memory_mb"],
            "loss": run["loss"],
        }
    for row in rows.values():
        row["vs_fp32"] = row["samples_per_s"] / rows["fp32"]["samples_per_s"]
    return {"shape": shape, "batch": batch, "seq": seq, "rows": rows}


# ---- 2. throughput: the engine beside a hand-written loop ------------------------------
def throughput_section(dry: bool) -> dict[str, Any]:
    import side_by_side

    args = side_by_side.dry_run_sizes(side_by_side.parser().parse_args(["--out", "-"]))
    args.dry_run = dry
    return side_by_side.run_table(side_by_side.dry_run_sizes(args))


# ---- 2b. recomputation modes ------------------------------------------------------------
RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full"},
    "selective": {"recompute_granularity": "selective"},
    "full, block half": {"recompute_granularity": "full", "recompute_method": "block"},
}


def recompute_section(dry: bool) -> dict[str, Any]:
    """GPT-1.3B (tiny in a dry run), bf16, eager: tokens/s and peak memory per recompute mode,
    each against none."""
    import side_by_side

    from rapidformer import RapidformerConfig, RapidformerEngine
    from rapidformer.step_io import StepFunctions

    row = side_by_side.TINY[0] if dry else side_by_side.MODELS[1]
    seq, vocab, steps = (32, 512, 2) if dry else (side_by_side.SEQ, side_by_side.VOCAB, 10)
    rows: dict[str, dict[str, Any]] = {}
    for name, options in RECOMPUTE.items():
        if "recompute_method" in options:
            options = {**options, "recompute_num_layers": max(1, row.layers // 2)}
        config = RapidformerConfig.from_dict(
            {"lr": 1e-4, "precision": "bf16", "seq_length": seq, "micro_batch_size": row.batch,
             "log_interval": 10**9, **options}
        )  # fmt: skip
        engine = RapidformerEngine(config, builds_optimizer=True)
        reset_memory(engine.device)
        state = engine.compose(row.build(seq, vocab))
        ids = torch.randint(
            0, vocab, (row.batch, seq + 1), generator=torch.Generator().manual_seed(0)
        )
        ids = ids.to(engine.device)
        functions = StepFunctions(
            train_step=lambda b, m=state.model: side_by_side.next_token_loss(
                side_by_side.logits_of(m, b[:, :-1]), b
            ),
            weight=lambda b: b.shape[0],
        )
        elapsed, loss = timed_steps(engine, ids, functions, steps)
        measured = peak_mb(engine.device)
        estimate = _dry_run_mb(config, row, seq, vocab)
        rows[name] = {
            "tokens_per_s": row.batch * seq * steps / elapsed,
            "peak_memory_mb": measured,
            "dry_run_estimate_mb": estimate,
            "estimate_over_measured": estimate / measured if measured else None,
            "loss": float(loss),
        }
        print(f"recompute {name}: dry-run estimate / measured peak = {estimate:.0f} / "
              f"{measured:.0f} MiB", flush=True)  # fmt: skip
        engine.close()
        # The next mode's peak must not hold this one's model and optimizer.
        del state, functions, ids, loss
        gc.collect()
    for values in rows.values():
        values["speed_vs_none"] = values["tokens_per_s"] / rows["none"]["tokens_per_s"]
        values["memory_vs_none"] = values["peak_memory_mb"] / rows["none"]["peak_memory_mb"]
    return {"model": row.name, "rows": rows}


def _dry_run_mb(config: Any, row: Any, seq: int, vocab: int) -> float:
    """The dry run's estimate of one rank's peak for the row's model and flags (MiB)."""

    from rapidformer.dryrun import dry_run, gpt_workload

    shape = GPTConfig(
        vocab_size=vocab, num_layers=row.layers, hidden_size=row.hidden,
        num_attention_heads=row.heads, max_position_embeddings=seq, dropout=0.0,
    )  # fmt: skip
    work = gpt_workload(shape, row.batch)
    config = config.replace(train_iters=1)  # the dry run checks the flags of a whole run
    return dry_run(config, 1, work, row.name).worst.total / 2**20


# ---- 3. optimizers -----------------------------------------------------------------------
def optimizer_section(dry: bool) -> dict[str, Any]:
    from rapidformer.accel.optim.lamb import Lamb
    from rapidformer.accel.optim.optimizers import parameter_groups

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    layers, hidden = (2, 64) if dry else (24, 1024)
    model = GPTModel.build(
        GPTConfig(
            vocab_size=50304 if not dry else 512,
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=4 if dry else 16,
            max_position_embeddings=1024,
        ),
        device=device,
    )
    for parameter in model.parameters():
        parameter.grad = 1e-3 * torch.randn_like(parameter)
    groups = parameter_groups(model, 0.01)
    plain = [{k: v for k, v in g.items() if k != "trust_ratio"} for g in groups]
    builders: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "AdamW(fused=True)": lambda: torch.optim.AdamW(plain, lr=1e-4, fused=True),
        "rapidformer LAMB (foreach)": lambda: Lamb(groups, lr=1e-4, weight_decay=0.01),
        "rapidformer LAMB (torch.compile)": lambda: Lamb(
            groups, lr=1e-4, weight_decay=0.01, compiled=True
        ),
    }
    rows = {}
    for name, build in builders.items():
        optimizer = build()
        times = []
        for index in range(2 if dry else 12):
            sync(device)
            started = time.perf_counter()
            optimizer.step()
            sync(device)
            if index >= 2 or dry:
                times.append(time.perf_counter() - started)
        rows[name] = {"step_ms": statistics.median(times) * 1e3}
        del optimizer
    for row in rows.values():
        row["vs_fused_adamw"] = row["step_ms"] / rows["AdamW(fused=True)"]["step_ms"]
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "rows": rows}


# ---- 4. dynamic shape --------------------------------------------------------------------
def dynamic_section(dry: bool) -> dict[str, Any]:
    import dynamic_shape

    corpus = dynamic_shape.SkewedCorpus(256 if dry else 4096, seed=0)
    steps = 3 if dry else 40
    rows = {it: dynamic_shape.run(corpus, it, steps) for it in ("fixed-shape", "dynamic-shape")}
    ratio = rows["dynamic-shape"]["tokens_per_s"] / rows["fixed-shape"]["tokens_per_s"]
    return {"rows": rows, "dynamic_vs_fixed": ratio}


# ---- 5. ONNX Runtime ---------------------------------------------------------------------
def onnxruntime_section(dry: bool) -> dict[str, Any]:
    try:
        import onnxruntime
        from onnxruntime.training import api  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"onnxruntime-training is not installed here ({exc})"}
    import ort_training

    providers = onnxruntime.get_available_providers()
    batch = ort_training.batch_for("bert")
    rows = {}
    for ort in (False, True):
        engine, step = ort_training.compose("bert", 32 if dry else 256, ort)
        on_device = {k: v.to(engine.device) for k, v in batch.items()}
        times, _ = ort_training.train_steps(engine, step, on_device, 3 if dry else 10)
        rows["onnxruntime" if ort else "eager"] = {"step_ms": statistics.median(times) * 1e3}
        engine.close()
    return {"providers": providers, "rows": rows}


def async_save_section(dry: bool) -> dict[str, Any]:
    import async_save

    runs = {mode: async_save.measure(mode, "tiny" if dry else "full") for mode in async_save.MODES}
    rows = {}
    for mode, run in runs.items():
        writing = run["step_s_writing"]
        rows[mode] = {
            "stall_s": statistics.median(run["stall_s"]),
            "step_ms": statistics.median(run["step_s_quiet"][1:]) * 1e3,
            "step_ms_while_writing": statistics.median(writing) * 1e3 if writing else None,
            "checkpoint_gib": run["checkpoint_bytes"] / 2**30,
        }
    keys = ("final_parameters_sha256", "last_checkpoint_model_sha256")
    return {
        "rows": rows,
        "stall_ratio": rows["async"]["stall_s"] / rows["sync"]["stall_s"],
        "same_end_state": all(runs["sync"][k] == runs["async"][k] for k in keys),
    }


SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "precision": precision_section,
    "throughput": throughput_section,
    "recompute": recompute_section,
    "optimizers": optimizer_section,
    "dynamic_shape": dynamic_section,
    "onnxruntime": onnxruntime_section,
    "adapters": adapters_section,
    "packing": packing_section,
    "async_save": async_save_section,
}


def markdown(result: dict[str, Any]) -> list[str]:
    sections = result["sections"]
    lines = [f"# GPU suite{' (dry run: tiny shapes)' if result['dry_run'] else ''}", ""]
    for name, section in sections.items():
        status = section["status"]
        lines.append(f"## {name} ({status}, {section['seconds']:.0f} s)")
        lines.append("")
        if status != "ok":
            lines += ["```", section.get("error", "")[-1500:], "```", ""]
            continue
        data = section["data"]
        if "skipped" in data:
            lines += [f"Skipped: {data['skipped']}", ""]
            continue
        rows = data["rows"]
        skip = {"plan", "tokens_per_s", "ratios", "warmup_s", "last_loss"}
        keys = sorted({k for row in rows.values() for k in row if k not in skip})
        lines.append("| | " + " | ".join(keys) + " |")
        lines.append("|---|" + "---|" * len(keys))
        for row_name, row in rows.items():
            cells = [_fmt(row.get(k)) for k in keys]
            lines.append(f"| {row_name} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, < 2 min)")
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json / .md")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run these sections")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows are fp32, as the table says
    if args.dry_run:
        # The code paths, not the kernels: dynamo's graphs as on the GPU (graph counts and
        # fallbacks), without inductor's C++ builds (minutes on a CPU; tests/accel/compile checks
        # inductor's numbers). The plan rows name the backend.
        from rapidformer.accel.compile import apply as compile_apply

        compile_apply.BACKEND = "eager"
    sections: dict[str, Any] = {}
    for name in args.only or list(SECTIONS):
        started = time.perf_counter()
        try:
            sections[name] = {"status": "ok", "data": SECTIONS[name](args.dry_run)}
        except (Exception, SystemExit):  # noqa: BLE001 (a broken section must not cost the others)
            sections[name] = {"status": "failed", "error": traceback.format_exc()}
        sections[name]["seconds"] = time.perf_counter() - started
        print(f"{name}: {sections[name]['status']} in {sections[name]['seconds']:.0f} s")
        (out / "gpu_suite.json").write_text(json.dumps(sections, indent=2, default=str))
    result = stamp({"dry_run": args.dry_run, "sections": sections})
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "gpu_suite.md").write_text("\n".join([*markdown(result), *footer(result)]))
    print(f"wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'}")
    failed = [n for n, s in sections.items() if s["status"] != "ok"]
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
