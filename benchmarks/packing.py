"""Padding-free packing against padding, side by side: learned tokens/s, peak memory, eval loss.

A small Llama (hidden 512, 4 layers, vocabulary 4,096: a row of 512 tokens is as long as the
model is wide, as a 2,048-wide model on rows of 2,048) trains one epoch over 256 samples whose
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
count in every mode) over the time of the epoch's steps. Every mode trains in a process of its
own (its own heap, as a training run has), and the modes take their steps in turn (this
machine's speed drifts by 10-20% over minutes; in turn, the drift falls on every mode alike),
each after a forward and backward of each shape its epoch holds (a run's later epochs). The
same runs with every mode in one shared process are measured beside them, and each step's page
faults. Peak: each mode alone in its own process with ``MALLOC_MMAP_THRESHOLD_`` fixed (freed
buffers leave the resident set), the resident set's peak during the epoch minus the resident
set before the model was built. Eval loss: after the epoch, on 64 held-out samples run one by
one (the same evaluation for every mode; it differs between modes only by the order the
epoch's samples came in).

    .venv/bin/python benchmarks/packing.py            # full run, writes result files
    .venv/bin/python benchmarks/packing.py --quick    # 128 samples, 1 run each, writes nothing
    .venv/bin/python benchmarks/packing.py --profile packed --samples 128  # where its time goes

Where the ratio to the buckets comes from: the matrix multiplies scale with token slots
(padding included) and run at this CPU's peak in every mode (``--profile`` prints their
GFLOP/s beside the engine's matmul probe), so the ratio of the modes' slots, which the page
shows as the slot bound, is what packing gains before attention; what packed rows add beyond
it is the attention of each sample alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from activation_memory import peak_rss_kib, rss_kib
from packing_epoch import HELD_OUT, SEQ, EpochRun, batches, corpus, llama

RESULT_PREFIX = "RESULT "
CPU_MODES = ("padded", "buckets", "packed-mask", "packed")
COMPARED = (("packed", "padded"), ("packed", "buckets"), ("packed", "packed-mask"))


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


def served_child(mode: str, count: int, seed: int) -> None:
    """One mode's epoch in this process, a step each time its parent writes ``step``: the
    parent steps every mode's process in turn (:class:`ServedRun`)."""
    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    run = EpochRun(batches(mode, samples, seed), samples, held_out, llama(), {},
                   per_sample_attention=mode == "packed")  # fmt: skip
    print(f"READY {len(run.epoch)}", flush=True)
    for command in sys.stdin:
        if command.strip() != "step":
            break
        run.step()
        print(f"STEPPED {len(run.losses)}", flush=True)
    result = run.finish()
    result.pop("device")
    print(RESULT_PREFIX + json.dumps(result), flush=True)


class ServedRun:
    """A mode's epoch in a process of its own (its own heap, as a training run has), built and
    warmed up, stepped when :meth:`step` says."""

    def __init__(self, mode: str, count: int, seed: int) -> None:
        # The child's stderr, shown if it fails; open as long as the child lives.
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.command = [sys.executable, __file__, "--serve", mode, "--samples", str(count),
                        "--seed", str(seed)]  # fmt: skip
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
        )  # fmt: skip
        self.steps, self.done = int(self.expect("READY")), 0

    def expect(self, word: str) -> str:
        """The rest of the child's next stdout line that starts with ``word``."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(word + " "):
                return line[len(word) + 1 :]
        self.process.wait()
        self.log.seek(0)
        sys.exit(f"child {' '.join(self.command)} failed ({self.process.returncode}):\n"
                 f"{self.log.read()}")  # fmt: skip

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def step(self) -> None:
        self.send("step")
        self.expect("STEPPED")
        self.done += 1

    def finish(self) -> dict[str, Any]:
        self.send("finish")
        result: dict[str, Any] = json.loads(self.expect(RESULT_PREFIX.strip()))
        self.process.wait()
        self.log.close()
        return result


def lockstep(count: int, seed: int) -> dict[str, dict[str, Any]]:
    """Every mode's epoch, each in its own process, their steps taken in turn (the mode
    furthest behind in its epoch goes next; the others wait on their input and use no CPU):
    this machine's speed drifts by 10-20% over minutes, and in turn the drift falls on every
    mode alike, while each mode's allocator sees only its own buffers, as in a training run."""
    runs = {mode: ServedRun(mode, count, seed) for mode in CPU_MODES}
    while left := [run for run in runs.values() if run.done < run.steps]:
        min(left, key=lambda run: run.done / run.steps).step()
        time.sleep(0.01)  # the last child's OpenMP threads stop spinning before the next starts
    return {mode: run.finish() for mode, run in runs.items()}


def shared_child(count: int, seed: int) -> None:
    """Every mode's epoch in this one process, their steps interleaved as in :func:`lockstep`:
    the protocol of the earlier runs (one heap for every mode), measured beside it."""
    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    runs = {
        mode: EpochRun(batches(mode, samples, seed), samples, held_out, llama(), {},
                       per_sample_attention=mode == "packed")
        for mode in CPU_MODES
    }  # fmt: skip
    while left := [mode for mode, run in runs.items() if not run.done]:
        runs[min(left, key=lambda mode: runs[mode].progress)].step()
    results = {mode: run.finish() for mode, run in runs.items()}
    for result in results.values():
        result.pop("device")
    print(RESULT_PREFIX + json.dumps(results), flush=True)


PROFILES = Path(__file__).parent / "results/packing_profile.json"
"""Each mode's last ``--profile``: what the docs cite of where an epoch's time goes."""


def profile(mode: str, count: int, seed: int) -> None:
    """One epoch of ``mode`` under the profiler: the operators that took the most time, and
    the matrix multiplies' share and rate against the engine's matmul probe of this CPU,
    kept in :data:`PROFILES` under ``mode``."""
    from common import stamp
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from rapidformer.hardware import probe_cpu_tflops

    samples, held_out = corpus(count), corpus(HELD_OUT, seed=1)
    run = EpochRun(batches(mode, samples, seed), samples, held_out, llama(), {},
                   per_sample_attention=mode == "packed")  # fmt: skip
    with profiler(activities=[ProfilerActivity.CPU], with_flops=True) as recorded:
        while run.step():
            pass
    run.engine.close()
    events = recorded.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    total = sum(event.self_cpu_time_total for event in events) / 1e6
    matmul = [event for event in events if event.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    seconds = sum(event.self_cpu_time_total for event in matmul) / 1e6
    attention = sum(event.self_cpu_time_total for event in events
                    if "scaled_dot_product" in event.key) / 1e6  # fmt: skip
    found = {
        "samples": count, "steps": len(run.epoch), "epoch_seconds": run.seconds,
        "operator_seconds": total, "matmul_seconds": seconds, "attention_seconds": attention,
        "matmul_gflops": sum(event.flops for event in matmul) / max(seconds, 1e-9) / 1e9,
        "probe_gflops": 1e3 * probe_cpu_tflops("fp32"),
    }  # fmt: skip
    print(
        f"{mode}: {found['steps']} steps, {run.seconds:.2f} s; matrix multiplies {seconds:.2f} "
        f"s ({100 * seconds / total:.0f}% of the operators' time) at "
        f"{found['matmul_gflops']:.0f} GFLOP/s (the engine's matmul probe now: "
        f"{found['probe_gflops']:.0f}); attention {attention:.2f} s "
        f"({100 * attention / total:.0f}%)"
    )
    kept = json.loads(PROFILES.read_text()) if PROFILES.is_file() else {}
    PROFILES.write_text(json.dumps({**kept, mode: stamp(found)}, indent=1) + "\n")
    print(f"wrote {PROFILES.relative_to(Path(__file__).parents[1])}")


def slot_bound(summary: dict[str, dict[str, Any]]) -> float:
    """The buckets' token slots over the packed rows' (the same samples, so the ratio of
    their unpadded shares): packed's speed over the buckets' if every slot cost the same."""
    return (1 - summary["packed"]["padding"]) / (1 - summary["buckets"]["padding"])


def eval_gap(packed: dict[str, Any], other: dict[str, Any], runs: int, name: str) -> str:
    """A packed mode's eval loss against ``other``'s, with the noise of the data order: the
    gap's standard error from the two modes' spreads over ``runs`` orders."""
    gap = packed["eval_loss"] - other["eval_loss"]
    error = ((packed["eval_loss_sd"] ** 2 + other["eval_loss_sd"] ** 2) / runs) ** 0.5
    verdict = "within noise" if abs(gap) <= 2 * error else "beyond noise"
    if runs < 2:
        verdict = "one data order, so no noise measured"
    return f"eval loss, {name}: {gap:+.4f}, two standard errors {2 * error:.4f}: {verdict}"


def paired(runs: dict[str, list[dict[str, Any]]], mode: str, other: str) -> float:
    """``mode``'s speed over ``other``'s: the median of the ratios within each run."""
    return statistics.median(
        a["learned_tokens_per_s"] / b["learned_tokens_per_s"]
        for a, b in zip(runs[mode], runs[other], strict=True)
    )


def main() -> None:
    from activation_memory import run_script_child
    from common import argument_parser, stamp

    parser = argument_parser(__doc__ or "", quick="128 samples, one run of each mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--child", choices=CPU_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--serve", choices=CPU_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--shared-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", choices=CPU_MODES, help="profile one epoch of this mode, run nothing else"
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--rewrite", action="store_true", help="rewrite the page from the results JSON, run nothing"
    )
    args = parser.parse_args()
    if args.rewrite:
        write_page(json.loads((Path(__file__).parent / "results/packing.json").read_text()))
        return
    if args.child:
        return child(args.child, args.samples, args.seed)
    if args.serve:
        return served_child(args.serve, args.samples, args.seed)
    if args.shared_process:
        return shared_child(args.samples, args.seed)
    if args.profile:
        return profile(args.profile, args.samples, args.seed)
    count, repeats = (128, 1) if args.quick else (args.samples, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in CPU_MODES}  # own processes
    shared: dict[str, list[dict[str, Any]]] = {mode: [] for mode in CPU_MODES}  # one process
    for repeat in range(repeats):
        protocols = [("own processes", runs), ("one process", shared)]
        for name, into in protocols[:: 1 if repeat % 2 == 0 else -1]:  # each first in turn
            results = (
                lockstep(count, repeat) if into is runs else run_script_child(
                    __file__, "--shared-process", "--samples", str(count), "--seed", str(repeat),
                    measures_memory=False)
            )  # fmt: skip
            for mode in CPU_MODES:
                run = results[mode]
                into[mode].append(run)
                print(
                    f"run {repeat + 1}/{repeats}, {name:13s} {mode:11s} "
                    f"{run['learned_tokens_per_s']:6.0f} learned tokens/s, padding "
                    f"{100 * run['padding']:4.1f}%, eval loss {run['eval_loss']:.4f}, "
                    f"{run['minor_faults_per_step']:6.0f} page faults per step",
                    flush=True,
                )
    alone = {mode: run_script_child(__file__, "--child", mode, "--samples", str(count))
             for mode in CPU_MODES}  # fmt: skip
    for mode, run in alone.items():
        print(f"memory run {mode:11s} peak {run['peak_mib']:6.1f} MiB", flush=True)
    summary = {
        mode: {
            "learned_tokens_per_s": statistics.median(r["learned_tokens_per_s"] for r in rs),
            "peak_mib": alone[mode]["peak_mib"],
            "eval_loss": statistics.mean(r["eval_loss"] for r in rs),
            "eval_loss_sd": statistics.stdev([r["eval_loss"] for r in rs]) if len(rs) > 1 else 0.0,
            "padding": rs[0]["padding"],
            "micro_batches": rs[0]["micro_batches"],
            "minor_faults_per_step": statistics.median(r["minor_faults_per_step"] for r in rs),
        }
        for mode, rs in runs.items()
    }
    ratios = {f"{a} / {b}": paired(runs, a, b) for a, b in COMPARED}
    versus_buckets = {mode: paired(runs, mode, "buckets") for mode in CPU_MODES}
    shared_ratios = {f"{a} / {b}": paired(shared, a, b) for a, b in COMPARED}
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x learned tokens/s (in one process: {shared_ratios[name]:.2f}x)")
    print(f"slot bound (buckets' token slots / packed rows'): {slot_bound(summary):.2f}x")
    gaps = [eval_gap(summary[a], summary[b], repeats, f"{a} - {b}") for a, b in COMPARED]
    print(*gaps, sep="\n")
    if args.quick:
        return
    result = stamp({"samples": count, "seq": SEQ, "repeats": repeats, "summary": summary,
                    "ratios": ratios, "versus_buckets": versus_buckets,
                    "shared_ratios": shared_ratios, "runs": runs, "shared_runs": shared,
                    "alone": alone})  # fmt: skip
    print(RESULT_PREFIX + json.dumps(result), flush=True)  # kept in the log if the page fails
    write_page(result)


def per_run(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Packed's speed over the buckets' in each run, in the order of the runs."""
    return ", ".join(
        f"{a['learned_tokens_per_s'] / b['learned_tokens_per_s']:.2f}x"
        for a, b in zip(runs["packed"], runs["buckets"], strict=True)
    )


def write_page(result: dict[str, Any]) -> None:
    """benchmarks/results/packing.json and docs/results/packing.md (and its chart) from a
    run's ``result``: what ``--rewrite`` redoes from the JSON after a change of wording."""
    from common import write_results

    summary, ratios, shared = result["summary"], result["ratios"], result["shared_runs"]
    versus_buckets, shared_ratios = result["versus_buckets"], result["shared_ratios"]
    count, repeats = result["samples"], result["repeats"]
    gaps = [eval_gap(summary[a], summary[b], repeats, f"{a} - {b}") for a, b in COMPARED]
    rows = []
    for mode, s in summary.items():
        in_one = statistics.median(r["learned_tokens_per_s"] for r in shared[mode])
        faults_in_one = statistics.median(r["minor_faults_per_step"] for r in shared[mode])
        rows.append(
            f"| {mode} | {s['micro_batches']} | {100 * s['padding']:.1f}% | "
            f"{s['learned_tokens_per_s']:.0f} ({versus_buckets[mode]:.2f}x) | "
            f"{in_one:.0f} ({paired(shared, mode, 'buckets'):.2f}x) | "
            f"{s['minor_faults_per_step']:,.0f} / {faults_in_one:,.0f} | "
            f"{s['peak_mib']:.0f} | {s['eval_loss']:.4f} ± {s['eval_loss_sd']:.4f} |"
        )
    write_results("packing", result, [
        "# Padding-free packing against padding",
        "",
        f"A Llama of hidden 512, 4 layers, one epoch over {count} samples of long-tailed "
        f"lengths (median about 65 tokens, up to {SEQ}), fp32, AdamW, on the CPU, every mode "
        "from the same weights. Speed: "
        f"{repeats} runs, each in another data order (the sampler's seed). In each run every "
        "mode trains in a process of its own (its own heap, as a training run has), and the "
        "modes take their steps in turn, the one furthest behind in its epoch next: this "
        "machine's speed drifts by 10-20% over minutes, and in turn the drift falls on every "
        "mode alike. Before the timed epoch each mode has run a forward and backward of each "
        "shape the epoch holds (with no update), as a run's later epochs have. Learned "
        "tokens/s is the epoch's learned tokens (the same in every mode) over the time of its "
        "steps, medians; ratios are the medians of the ratios within each run. Peak: "
        "each mode alone in its own process, with `MALLOC_MMAP_THRESHOLD_` fixed so that "
        "freed buffers leave the resident set. Eval loss: on 64 held-out samples after the "
        "epoch, mean ± standard deviation over the data orders.",
        "",
        f"Packed: {ratios['packed / padded']:.2f}x the learned tokens/s of padding to the "
        f"longest, {ratios['packed / buckets']:.2f}x rapidformer's dynamic-shape buckets "
        f"(the runs: {per_run(result['runs'])}; in one process: {per_run(shared)}), "
        f"{ratios['packed / packed-mask']:.2f}x the same rows under the whole mask (the "
        "per-sample attention's own gain). The slot bound, the buckets' token slots over the "
        f"packed rows' (their padding {100 * summary['buckets']['padding']:.1f}% against "
        f"{100 * summary['packed']['padding']:.1f}%), is {slot_bound(summary):.2f}x: the "
        "ratio if every slot cost the same. The matrix multiplies cost the same per slot in "
        "every mode; where they run at the CPU's peak (`--profile` says whether), packed rows "
        "go past the bound only by what their attention saves.",
        "",
        "The same runs with every mode in one shared process (one run of each protocol per "
        "data order, each first in turn): "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in shared_ratios.items())
        + ". There the modes share one heap, which no training run does, so the headline is "
        "the runs in processes of their own. Page faults per step: the pages the kernel "
        "mapped in during a mode's steps (memory the allocator had to ask for afresh), per "
        "protocol.",
        "",
        *(f"- {gap}" for gap in gaps),
        "",
        "| mode | micro-batches | padding | learned tokens/s (x buckets) | in one process "
        "(x buckets) | page faults per step (own process / one process) | peak, MiB | "
        "eval loss |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


if __name__ == "__main__":
    main()
