"""torch.compile per block vs eager: training step time and the cost of the first compile.

A TinyTransformerLM (hidden 256, 4 layers, 8 heads) trains on fixed batches of 16 x 128 tokens
through RapidformerEngine, once composed plainly and once with --torch-compile. The compiled
engine's first steps (the cold compile, into an empty inductor cache) are timed separately;
then rounds alternate eager and compiled (several steps each) and the medians of per-step
times give the ratio. Runs on CUDA when available (the engine picks the device), else CPU.

    .venv/bin/python benchmarks/compile.py           # full run, writes result files
    .venv/bin/python benchmarks/compile.py --quick   # smoke test, writes nothing
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch
from common import argument_parser, stamp, write_results

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.testing import TinyTransformerLM, lm_loss

HIDDEN, LAYERS, HEADS, BATCH, SEQ = 256, 4, 8, 16, 128


def compose(scope: str | None, cache: str, hidden: int) -> tuple[RapidformerEngine, Any]:
    """An engine and its state: eager (``scope`` None) or compiled with that scope."""
    options: dict[str, Any] = {"lr": 1e-3, "lr_decay_style": "constant"}
    if scope is not None:
        options.update(torch_compile=True, torch_compile_cache_dir=cache)
        options.update(torch_compile_scope=scope)
    engine = RapidformerEngine(RapidformerConfig.from_dict(options))
    torch.manual_seed(0)
    model = TinyTransformerLM(hidden=hidden, layers=LAYERS, heads=HEADS, max_positions=SEQ)
    return engine, engine.compose(model)


def train_steps(
    engine: RapidformerEngine, batch: dict[str, torch.Tensor], steps: int
) -> list[float]:
    times, model = [], engine.state.model  # type: ignore[union-attr]
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(lm_loss(model, batch)["loss"])
        result = engine.step()
        assert result is not None
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argument_parser(__doc__, "hidden 64, 1 round of 3 steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per engine per round")
    args = parser.parse_args()
    hidden, rounds, steps = (64, 1, 3) if args.quick else (HIDDEN, args.rounds, args.steps)
    cache = tempfile.mkdtemp(prefix="inductor-cache-")
    eager_engine, _ = compose(None, cache, hidden)
    compiled_engine, state = compose("blocks", cache, hidden)
    whole_engine, _ = compose("model", cache, hidden)
    engines = {"eager": eager_engine, "compiled": compiled_engine, "compiled (model)": whole_engine}
    ids = torch.randint(1, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    batch = {k: v.to(eager_engine.device) for k, v in batch.items()}
    first = train_steps(compiled_engine, batch, 2)  # cold compile of forward and backward
    first_whole = train_steps(whole_engine, batch, 2)
    train_steps(eager_engine, batch, 2)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            times[name] += train_steps(engine, batch, steps)
        print(
            f"round {r + 1}/{rounds} "
            + "  ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms" for n, t in times.items())
        )
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    speedup = median_ms["eager"] / median_ms["compiled"]
    whole_speedup = median_ms["eager"] / median_ms["compiled (model)"]
    device = str(eager_engine.device)
    print(
        f"first compiled steps {first[0]:.1f} s + {first[1]:.2f} s; compiled speedup {speedup:.2f}x"
        f" (blocks), {whole_speedup:.2f}x (model, first step {first_whole[0]:.1f} s)"
    )
    if args.quick:
        return
    plan = next(str(p) for p in state.plan if str(p).startswith("compile"))
    result = stamp(
        {
            "device": device,
            "shape": {"hidden": hidden, "layers": LAYERS, "batch": BATCH, "seq": SEQ},
            "rounds": rounds,
            "steps_per_round": steps,
            "first_compiled_step_s": first[0],
            "first_compiled_step_s_model_scope": first_whole[0],
            "median_step_ms": median_ms,
            "speedup": speedup,
            "speedup_model_scope": whole_speedup,
            "compile_metrics": {n: e.step_metrics() for n, e in engines.items() if n != "eager"},
            "plan": plan,
            "times_s": times,
        }
    )
    write_results(f"compile_{eager_engine.device.type}", result, [
        f"# torch.compile vs eager ({device})",
        "",
        f"TinyTransformerLM hidden {hidden}, {LAYERS} layers, {HEADS} heads; batch {BATCH} x "
        f"{SEQ} tokens; a training step is forward, backward and fused AdamW through "
        f"RapidformerEngine. {rounds} interleaved rounds of {steps} steps each; medians.",
        f"Plan: `{plan}`.",
        "",
        "| | median step (ms) |",
        "|---|---|",
        *(f"| {name} | {ms:.1f} |" for name, ms in median_ms.items()),
        "",
        f"**compiled / eager speed: {speedup:.2f}x** per block (`--torch-compile-scope blocks`), "
        f"**{whole_speedup:.2f}x** whole model (`--torch-compile-scope model`); first compiled "
        f"step (cold compile, empty cache): {first[0]:.1f} s (blocks), {first_whole[0]:.1f} s "
        "(model).",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
