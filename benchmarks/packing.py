"""Padding-free packing against padding, side by side: learned tokens/s, peak memory, eval loss.

A small Llama (hidden 512, 4 layers, vocabulary 4,096: a row of 512 tokens is as long as the
model is wide, as a 2,048-wide model on rows of 2,048) trains one epoch over 512 samples whose
lengths follow a long-tailed law like FLAN's (log-normal, median about 65 tokens, a few up to
--seq-length 512), each mode from the same initial weights, fp32, AdamW:

* ``padded``: shuffled, 8 samples per micro-batch, each batch padded to its longest sample
  (transformers' ``DataCollatorWithPadding``);
* ``buckets``: rapidformer's dynamic-shape iterator (``--data-iterator dynamic-shape``):
  similar lengths grouped, 8 samples per micro-batch, padded to one of a few bucket lengths;
* ``packed``: ``--packing``: the samples in rows of 512 tokens (best-fit decreasing), 2 rows per
  micro-batch (about the tokens of 8 samples), a block-diagonal mask, and the attention run
  one sample at a time, causal SDPA with no mask (what ``--packing`` runs on the CPU:
  :mod:`rapidformer.models.packed_attention`);
* ``packed-mask``: the same rows through transformers' sdpa over the whole mask (what a GPU
  runs, and a compiled model): what running each sample alone saves.

Learned tokens/s: the epoch's learned tokens (every token but each sample's first, the same
count in every mode) over the time of the epoch's steps, every mode trained in one process with
their steps interleaved (this machine's speed drifts by 10-20% over minutes; interleaved, the
drift falls on every mode alike), under glibc's own mmap threshold as a training run is. Peak:
each mode alone in its own process with ``MALLOC_MMAP_THRESHOLD_`` fixed (freed buffers leave
the resident set), the resident set's peak during the epoch minus the resident set before the
model was built. Eval loss: after the
epoch, on 64 held-out samples run one by one (the same evaluation for every mode; it differs
between modes only by the order the epoch's samples came in).

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
CPU_MODES = ("padded", "buckets", "packed-mask", "packed")
SEQ, VOCAB, MICRO_BATCH, PACKED_ROWS, HELD_OUT = 512, 4096, 8, 2, 64
COMPARED = (("packed", "padded"), ("packed", "buckets"), ("packed", "packed-mask"))


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
    if mode.startswith("packed"):
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


def llama() -> Callable[[], torch.nn.Module]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ,
    )  # fmt: skip
    return lambda: transformers.LlamaForCausalLM(config)


def child(mode: str, count: int, seed: int) -> None:
    """One mode's epoch alone in this process: its peak memory."""
    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    epoch = batches(mode, samples, seed)
    baseline = rss_kib()
    run = EpochRun(epoch, samples, held_out, llama(), {}, per_sample_attention=mode == "packed")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    while run.step():
        pass
    result = run.finish()
    result.pop("device")
    result.update(mode=mode, peak_mib=(peak_rss_kib() - baseline) / 1024)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def interleaved_child(count: int, seed: int) -> None:
    """Every mode's epoch in this process, their steps interleaved (the mode furthest behind in
    its epoch steps next): this machine's speed drifts by 10-20% over minutes, and here the
    drift falls on every mode alike."""
    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    runs = {
        mode: EpochRun(batches(mode, samples, seed), samples, held_out, llama(), {},
                       per_sample_attention=mode == "packed")
        for mode in CPU_MODES
    }  # fmt: skip
    while True:
        left = [mode for mode, run in runs.items() if not run.done]
        if not left:
            break
        runs[min(left, key=lambda mode: runs[mode].progress)].step()
    results = {mode: run.finish() for mode, run in runs.items()}
    for result in results.values():
        result.pop("device")
    print(RESULT_PREFIX + json.dumps(results), flush=True)


class EpochRun:
    """One epoch of ``epoch``'s micro-batches (made of ``samples``) through the engine
    (AdamW, lr 1e-3, ``options``) on the device it picks, from the weights ``build_model``
    makes after seeding, a step at a time (so that several can interleave), then the loss on
    ``held_out`` one by one. Built, it has run a warm-up step (allocations, the optimizer's
    state). ``per_sample_attention``: packed rows run as ``--packing`` runs them (one sample at a
    time on the CPU, the whole mask elsewhere); else through sdpa over the whole mask."""

    def __init__(
        self,
        epoch: list[dict[str, torch.Tensor]],
        samples: list[dict[str, list[int]]],
        held_out: list[dict[str, list[int]]],
        build_model: Callable[[], torch.nn.Module],
        options: dict[str, Any],
        per_sample_attention: bool = False,
    ) -> None:
        from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions
        from rapidformer.models.packed_attention import prepare_packed
        from rapidformer.templates.tasks import CausalLM

        torch.manual_seed(0)
        model = build_model()
        self.engine = RapidformerEngine(
            RapidformerConfig.from_dict({"lr": 1e-3, **options}), builds_optimizer=True
        )
        self.device = self.engine.device
        task = CausalLM(SimpleNamespace(pad_token_id=0), SEQ)  # type: ignore[arg-type]
        task.per_sample_attention = per_sample_attention and prepare_packed(model, self.device)
        self.state = state = self.engine.compose(model)
        self.epoch = [{key: value.to(self.device) for key, value in batch.items()}
                      for batch in epoch]  # fmt: skip
        self.samples, self.held_out = samples, held_out

        def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return task.loss(state.model(**task.inputs(batch)), batch)

        self.functions = StepFunctions(train_step=loss, weight=task.weight)
        self.engine.run_step([self.epoch[0]], self.functions)  # warm-up
        self.losses: list[torch.Tensor] = []
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return len(self.losses) == len(self.epoch)

    @property
    def progress(self) -> float:
        return len(self.losses) / len(self.epoch)

    def step(self) -> bool:
        """The next micro-batch, timed; whether any is left."""
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        synchronize()
        started = time.perf_counter()
        batch = self.epoch[len(self.losses)]
        self.losses.append(self.engine.run_step([batch], self.functions).loss_tensor)
        synchronize()
        self.seconds += time.perf_counter() - started
        return not self.done

    def finish(self) -> dict[str, Any]:
        from rapidformer.state import evaluation_context

        learned = sum(len(s["input_ids"]) - 1 for s in self.samples)
        total, tokens = 0.0, 0
        with evaluation_context(self.state):  # no gradients, the training precision
            for sample in self.held_out:
                ids = torch.tensor([sample["input_ids"]], device=self.device)
                logits = self.state.unwrapped_model(input_ids=ids).logits[0, :-1].float()
                total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                tokens += ids.shape[1] - 1
        slots = sum(int(b["input_ids"].numel()) for b in self.epoch)
        self.engine.close()
        return {
            "micro_batches": len(self.epoch),
            "padding": 1 - (learned + len(self.samples)) / slots,
            "seconds": self.seconds,
            "learned_tokens_per_s": learned / self.seconds,
            "eval_loss": total / tokens,
            "first_loss": float(self.losses[0]),
            "last_loss": float(self.losses[-1]),
            "device": self.device,
        }


def train_epoch(
    epoch: list[dict[str, torch.Tensor]],
    samples: list[dict[str, list[int]]],
    held_out: list[dict[str, list[int]]],
    build_model: Callable[[], torch.nn.Module],
    options: dict[str, Any],
    on_start: Callable[[torch.device], None],
    per_sample_attention: bool = False,
) -> dict[str, Any]:
    """:class:`EpochRun` from start to end; ``on_start`` runs just before the timed epoch
    (after the warm-up step): where the caller starts its peak memory."""
    run = EpochRun(epoch, samples, held_out, build_model, options, per_sample_attention)
    gc.collect()
    on_start(run.device)
    while run.step():
        pass
    return run.finish()


def eval_gap(packed: dict[str, Any], other: dict[str, Any], runs: int, name: str) -> str:
    """A packed mode's eval loss against ``other``'s, with the noise of the data order: the
    gap's standard error from the two modes' spreads over ``runs`` orders."""
    gap = packed["eval_loss"] - other["eval_loss"]
    error = ((packed["eval_loss_sd"] ** 2 + other["eval_loss_sd"] ** 2) / runs) ** 0.5
    verdict = "within noise" if abs(gap) <= 2 * error else "beyond noise"
    if runs < 2:
        verdict = "one data order, so no noise measured"
    return f"eval loss, {name}: {gap:+.4f}, two standard errors {2 * error:.4f}: {verdict}"


def main() -> None:
    from activation_memory import run_script_child
    from common import argument_parser, stamp

    parser = argument_parser(__doc__ or "", quick="128 samples, one run of each mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--child", choices=CPU_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--rewrite", action="store_true", help="rewrite the page from the results JSON, run nothing"
    )
    args = parser.parse_args()
    if args.rewrite:
        write_page(json.loads((Path(__file__).parent / "results/packing.json").read_text()))
        return
    if args.child:
        child(args.child, args.samples, args.seed)
        return
    if args.interleaved:
        interleaved_child(args.samples, args.seed)
        return
    count, repeats = (128, 1) if args.quick else (args.samples, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in CPU_MODES}
    for repeat in range(repeats):
        results = run_script_child(
            __file__, "--interleaved", "--samples", str(count), "--seed", str(repeat),
            measures_memory=False,
        )  # fmt: skip
        for mode in CPU_MODES:
            run = results[mode]
            runs[mode].append(run)
            print(
                f"run {repeat + 1}/{repeats} {mode:11s} {run['learned_tokens_per_s']:8.0f} learned "
                f"tokens/s, padding {100 * run['padding']:4.1f}%, eval loss {run['eval_loss']:.4f}",
                flush=True,
            )
    alone = {mode: run_script_child(__file__, "--child", mode, "--samples", str(count))
             for mode in CPU_MODES}  # fmt: skip
    for mode, run in alone.items():
        print(f"alone {mode:11s} {run['learned_tokens_per_s']:8.0f} learned tokens/s, peak "
              f"{run['peak_mib']:6.1f} MiB", flush=True)  # fmt: skip
    summary = {
        mode: {
            "learned_tokens_per_s": statistics.median(r["learned_tokens_per_s"] for r in rs),
            "peak_mib": alone[mode]["peak_mib"],
            "eval_loss": statistics.mean(r["eval_loss"] for r in rs),
            "eval_loss_sd": statistics.stdev([r["eval_loss"] for r in rs]) if len(rs) > 1 else 0.0,
            "padding": rs[0]["padding"],
            "micro_batches": rs[0]["micro_batches"],
        }
        for mode, rs in runs.items()
    }

    def paired(mode: str, other: str) -> float:
        """``mode``'s speed over ``other``'s: the median of the ratios within each run."""
        return statistics.median(
            a["learned_tokens_per_s"] / b["learned_tokens_per_s"]
            for a, b in zip(runs[mode], runs[other], strict=True)
        )

    ratios = {f"{a} / {b}": paired(a, b) for a, b in COMPARED}
    versus_buckets = {mode: paired(mode, "buckets") for mode in CPU_MODES}
    alone_ratios = {
        f"{a} / {b}": alone[a]["learned_tokens_per_s"] / alone[b]["learned_tokens_per_s"]
        for a, b in COMPARED
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x learned tokens/s (each mode alone: {alone_ratios[name]:.2f}x)")
    gaps = [eval_gap(summary[a], summary[b], repeats, f"{a} - {b}") for a, b in COMPARED]
    print(*gaps, sep="\n")
    if args.quick:
        return
    result = stamp({"samples": count, "seq": SEQ, "repeats": repeats, "summary": summary,
                    "ratios": ratios, "versus_buckets": versus_buckets,
                    "alone_ratios": alone_ratios, "runs": runs, "alone": alone})  # fmt: skip
    write_page(result)


def write_page(result: dict[str, Any]) -> None:
    """benchmarks/results/packing.json and docs/results/packing.md (and its chart) from a
    run's ``result``: what ``--rewrite`` redoes from the JSON after a change of wording."""
    from common import write_results

    summary, ratios = result["summary"], result["ratios"]
    versus_buckets, alone_ratios = result["versus_buckets"], result["alone_ratios"]
    count, repeats = result["samples"], result["repeats"]
    gaps = [eval_gap(summary[a], summary[b], repeats, f"{a} - {b}") for a, b in COMPARED]
    speed = {mode: s["learned_tokens_per_s"] for mode, s in summary.items()}
    rows = [
        f"| {mode} | {s['micro_batches']} | {100 * s['padding']:.1f}% | {speed[mode]:.0f} "
        f"({versus_buckets[mode]:.2f}x) | {s['peak_mib']:.0f} | "
        f"{s['eval_loss']:.4f} ± {s['eval_loss_sd']:.4f} |"
        for mode, s in summary.items()
    ]
    write_results("packing", result, [
        "# Padding-free packing against padding",
        "",
        f"A Llama of hidden 512, 4 layers, one epoch over {count} samples of long-tailed "
        f"lengths (median about 65 tokens, up to {SEQ}), fp32, AdamW, on the CPU. Speed: "
        f"{repeats} runs, each in another data order (the sampler's seed), each training every "
        "mode in one process with their steps interleaved (this machine's speed drifts by "
        "10-20% over minutes; interleaved, the drift falls on every mode alike), under glibc's "
        "own mmap threshold as a training run is; learned "
        "tokens/s is the epoch's learned tokens (the same in every mode) over the time of its "
        "steps, medians; packed's ratios are the medians of the ratios within each run. Peak: "
        "each mode alone in its own process, with `MALLOC_MMAP_THRESHOLD_` fixed so that "
        "freed buffers leave the resident set. Eval loss: on 64 held-out samples after the "
        "epoch, mean ± standard deviation over the data orders.",
        "",
        f"Packed: {ratios['packed / padded']:.2f}x the learned tokens/s of padding to the "
        f"longest, {ratios['packed / buckets']:.2f}x rapidformer's dynamic-shape buckets, "
        f"{ratios['packed / packed-mask']:.2f}x the same rows under the whole mask (the "
        "per-sample attention's own gain).",
        "",
        "Each mode alone in its own process, under the memory runs' fixed mmap threshold (one "
        "run each, the drift unpaired): "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in alone_ratios.items())
        + ". There every buffer over 128 KiB is mapped and faulted in afresh at each step, "
        "and the per-sample attention allocates its buffers per sample and layer where the "
        "whole mask allocates them per layer.",
        "",
        *(f"- {gap}" for gap in gaps),
        "",
        "| mode | micro-batches | padding | learned tokens/s (x buckets) | peak, MiB | "
        "eval loss |",
        "|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


if __name__ == "__main__":
    main()
