"""Padding-free packing against padding, side by side: learned tokens/s, peak memory, eval loss.

A small Llama (hidden 512, 4 layers, vocabulary 4,096: a row of 512 tokens is as long as the
model is wide, as a 2,048-wide model on rows of 2,048) trains one epoch over 512 samples whose
lengths follow a long-tailed law like FLAN's (log-normal, median about 65 tokens, a few up to
--seq-length 512), each mode in its own process from the same initial weights, fp32, AdamW:

* ``padded``: shuffled, 8 samples per micro-batch, each batch padded to its longest sample
  (transformers' ``DataCollatorWithPadding``);
* ``buckets``: rapidformer's dynamic-shape iterator (``--data-iterator dynamic-shape``):
  similar lengths grouped, 8 samples per micro-batch, padded to one of a few bucket lengths;
* ``packed``: ``--packing``: the samples in rows of 512 tokens (best-fit decreasing), 2 rows per
  micro-batch (about the tokens of 8 samples), a block-diagonal mask.

Learned tokens/s: the epoch's learned tokens (every token but each sample's first, the same
count in every mode) over the epoch's time. Peak: the resident set's peak during the epoch
minus the resident set before the model was built. Eval loss: after the epoch, on 64 held-out
samples run one by one (the same evaluation for every mode; it differs between modes only by
the order the epoch's samples came in).

    .venv/bin/python benchmarks/packing.py            # full run, writes result files
    .venv/bin/python benchmarks/packing.py --quick    # 128 samples, 1 run each, writes nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from activation_memory import peak_rss_kib, rss_kib

RESULT_PREFIX = "RESULT "
MODES = ("padded", "buckets", "packed")
SEQ, VOCAB, MICRO_BATCH, PACKED_ROWS, HELD_OUT = 512, 4096, 8, 2, 64


def corpus(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``count`` samples with long-tailed lengths (8 to SEQ tokens) of Markov-ish token ids."""
    rng = np.random.RandomState(seed)
    lengths = np.clip(rng.lognormal(mean=4.2, sigma=0.9, size=count), 8, SEQ).astype(int)
    samples = []
    for length in lengths:
        start = rng.randint(1, VOCAB)
        steps = rng.randint(1, 17, size=int(length))  # learnable: small steps through the ids
        ids = (start + np.cumsum(steps)) % (VOCAB - 1) + 1
        samples.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids)})
    return samples


def batches(
    mode: str, samples: list[dict[str, list[int]]], seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """One epoch's micro-batches, as ``mode`` lays them out, in the order of ``seed``."""
    from rapidformer.data.dynamic_shape import BucketCollate, LengthGroupedSampler, bucket_lengths
    from rapidformer.data.packing import collate_packed, pack_rows
    from rapidformer.data.samplers import ResumableDistributedSampler
    from rapidformer.templates.tasks import CausalLM

    task = CausalLM(SimpleNamespace(pad_token_id=0), SEQ)  # type: ignore[arg-type]
    if mode == "packed":
        rows = pack_rows(samples, SEQ)
        sampler = ResumableDistributedSampler(len(rows), micro_batch_size=PACKED_ROWS, seed=seed)
        order = list(sampler)
        return [collate_packed([rows[i] for i in order[s : s + PACKED_ROWS]], SEQ, 0)
                for s in range(0, len(order), PACKED_ROWS)]  # fmt: skip
    if mode == "buckets":
        lengths = [len(s["input_ids"]) for s in samples]
        order = list(LengthGroupedSampler(lengths, MICRO_BATCH, seed=seed))
        collate: Any = BucketCollate(task.collate, bucket_lengths(SEQ))
    else:
        order = list(
            ResumableDistributedSampler(len(samples), micro_batch_size=MICRO_BATCH, seed=seed)
        )

        def collate(group: list[Any]) -> Any:
            return task.collate(group, pad_to=max(len(s["input_ids"]) for s in group))

    return [collate([samples[i] for i in order[s : s + MICRO_BATCH]])
            for s in range(0, len(order), MICRO_BATCH)]  # fmt: skip


def child(mode: str, count: int, seed: int) -> None:
    import transformers

    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    epoch = batches(mode, samples, seed)
    baseline = rss_kib()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ,
    )  # fmt: skip

    def clear_peak(device: torch.device) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here

    result = train_epoch(
        epoch, samples, held_out, lambda: transformers.LlamaForCausalLM(config), {}, clear_peak
    )
    result.pop("device")
    result.update(mode=mode, peak_mib=(peak_rss_kib() - baseline) / 1024)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def train_epoch(
    epoch: list[dict[str, torch.Tensor]],
    samples: list[dict[str, list[int]]],
    held_out: list[dict[str, list[int]]],
    build_model: Callable[[], torch.nn.Module],
    options: dict[str, Any],
    on_start: Callable[[torch.device], None],
) -> dict[str, Any]:
    """One epoch of ``epoch``'s micro-batches (made of ``samples``) through the engine
    (AdamW, lr 1e-3, ``options``) on the device it picks, from the weights ``build_model``
    makes after seeding, then the loss on ``held_out`` one by one. ``on_start`` runs just before
    the timed epoch (after a warm-up step): where the caller starts its peak memory."""
    from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions
    from rapidformer.state import evaluation_context
    from rapidformer.templates.tasks import CausalLM

    torch.manual_seed(0)
    model = build_model()
    config = RapidformerConfig.from_dict({"lr": 1e-3, **options})
    engine = RapidformerEngine(config, builds_optimizer=True)
    state = engine.compose(model)
    device = engine.device
    epoch = [{key: value.to(device) for key, value in batch.items()} for batch in epoch]
    task = CausalLM(SimpleNamespace(pad_token_id=0), SEQ)  # type: ignore[arg-type]

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.loss(state.model(**task.inputs(batch)), batch)

    step = StepFunctions(train_step=loss, weight=task.weight)
    engine.run_step([epoch[0]], step)  # warm-up (allocations, the optimizer's state)
    gc.collect()
    on_start(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    started = time.perf_counter()
    losses = [engine.run_step([batch], step).loss_tensor for batch in epoch]
    synchronize()
    seconds = time.perf_counter() - started
    learned = sum(len(s["input_ids"]) - 1 for s in samples)
    total, tokens = 0.0, 0
    with evaluation_context(state):  # no gradients, the training precision
        for sample in held_out:
            ids = torch.tensor([sample["input_ids"]], device=device)
            logits = state.unwrapped_model(input_ids=ids).logits[0, :-1].float()
            total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            tokens += ids.shape[1] - 1
    slots = sum(int(b["input_ids"].numel()) for b in epoch)
    engine.close()
    return {
        "micro_batches": len(epoch),
        "padding": 1 - (learned + len(samples)) / slots,
        "seconds": seconds,
        "learned_tokens_per_s": learned / seconds,
        "eval_loss": total / tokens,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
        "device": device,
    }


def eval_gap(packed: dict[str, Any], other: dict[str, Any], runs: int, name: str) -> str:
    """Packed's eval loss against ``other``'s, with the noise of the data order: the gap's
    standard error from the two modes' spreads over ``runs`` orders."""
    gap = packed["eval_loss"] - other["eval_loss"]
    error = ((packed["eval_loss_sd"] ** 2 + other["eval_loss_sd"] ** 2) / runs) ** 0.5
    verdict = "within noise" if abs(gap) <= 2 * error else "beyond noise"
    if runs < 2:
        verdict = "one data order, so no noise measured"
    return f"eval loss, packed - {name}: {gap:+.4f}, two standard errors {2 * error:.4f}: {verdict}"


def main() -> None:
    from activation_memory import run_script_child
    from common import argument_parser, stamp, write_results

    parser = argument_parser(__doc__ or "", quick="128 samples, one run of each mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.samples, args.seed)
        return
    count, repeats = (128, 1) if args.quick else (args.samples, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES:  # interleaved
            run = run_script_child(
                __file__, "--child", mode, "--samples", str(count), "--seed", str(repeat)
            )
            runs[mode].append(run)
            print(
                f"run {repeat + 1}/{repeats} {mode:7s} {run['learned_tokens_per_s']:8.0f} learned "
                f"tokens/s, padding {100 * run['padding']:4.1f}%, peak {run['peak_mib']:6.1f} "
                f"MiB, eval loss {run['eval_loss']:.4f}",
                flush=True,
            )
    summary = {
        mode: {
            "learned_tokens_per_s": statistics.median(r["learned_tokens_per_s"] for r in rs),
            "peak_mib": statistics.median(r["peak_mib"] for r in rs),
            "eval_loss": statistics.mean(r["eval_loss"] for r in rs),
            "eval_loss_sd": statistics.stdev([r["eval_loss"] for r in rs]) if len(rs) > 1 else 0.0,
            "padding": rs[0]["padding"],
            "micro_batches": rs[0]["micro_batches"],
        }
        for mode, rs in runs.items()
    }
    packed = summary["packed"]
    ratios = {
        "packed / padded": packed["learned_tokens_per_s"]
        / summary["padded"]["learned_tokens_per_s"],
        "packed / buckets": packed["learned_tokens_per_s"]
        / summary["buckets"]["learned_tokens_per_s"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x learned tokens/s")
    gaps = [eval_gap(packed, summary[mode], repeats, mode) for mode in ("padded", "buckets")]
    print(*gaps, sep="\n")
    if args.quick:
        return
    result = stamp({"samples": count, "seq": SEQ, "repeats": repeats, "summary": summary,
                    "ratios": ratios, "runs": runs})  # fmt: skip
    speed = {mode: s["learned_tokens_per_s"] for mode, s in summary.items()}
    rows = [
        f"| {mode} | {s['micro_batches']} | {100 * s['padding']:.1f}% | {speed[mode]:.0f} "
        f"({speed['packed'] / speed[mode]:.2f}x) | {s['peak_mib']:.0f} | {s['eval_loss']:.4f} "
        f"± {s['eval_loss_sd']:.4f} |"
        for mode, s in summary.items()
    ]
    write_results("packing", result, [
        "# Padding-free packing against padding",
        "",
        f"A Llama of hidden 512, 4 layers, one epoch over {count} samples of long-tailed "
        f"lengths (median about 65 tokens, up to {SEQ}), fp32, AdamW, on the CPU; each mode in "
        f"its own process, {repeats} interleaved runs, each in another data order (the "
        "sampler's seed), medians. Learned tokens/s: the epoch's learned tokens (the same in "
        "every mode) over its time. Eval loss: on 64 held-out samples after the epoch, mean "
        "± standard deviation over the data orders.",
        "",
        f"Packed: {ratios['packed / padded']:.2f}x the learned tokens/s of padding to the "
        f"longest, {ratios['packed / buckets']:.2f}x rapidformer's dynamic-shape buckets.",
        "",
        *(f"- {gap}" for gap in gaps),
        "",
        "| mode | micro-batches | padding | learned tokens/s (packed: x this) | peak, MiB | "
        "eval loss |",
        "|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


if __name__ == "__main__":
    main()
