"""--onnx-runtime-training vs eager torch: training step time on the CPU.

Two models train on fixed random batches through RapidformerEngine (forward, backward, clipping,
fused AdamW): a Hugging Face BertForSequenceClassification and rapidformer's built-in GPT (both
hidden 128, 4 layers, 4 heads, dropout 0, batch 16 x 128 tokens). The ORT engine runs forward
and backward through rapidformer.accel.onnx.training.OrtTrainStep (onnxruntime-training's
training API, gradients handed to torch); the eager engine runs the same model in torch. The
first ORT step (export and gradient-graph build) is timed separately; then rounds alternate
eager and ORT (several steps each) and the medians of per-step times give the ratio. torch and
ORT both use the same number of intra-op threads (1 by default: the machine has 2 cores).

    .venv/bin/python benchmarks/ort_training.py           # full run, writes result files
    .venv/bin/python benchmarks/ort_training.py --quick   # smoke test, writes nothing
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import argument_parser, stamp, write_results
from torch import nn

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.accel.onnx.training import OrtTrainStep, ort_version
from rapidformer.models.gpt import GPTConfig, GPTModel

HIDDEN, LAYERS, HEADS, BATCH, SEQ, VOCAB = 128, 4, 4, 16, 128, 1000

Step = Callable[[dict[str, torch.Tensor]], Any]


def bert(hidden: int) -> tuple[nn.Module, Callable[[nn.Module], Step]]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * hidden,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=4,
    )
    model = transformers.BertForSequenceClassification(config)

    def step(m: nn.Module) -> Step:
        def run(batch: dict[str, torch.Tensor]) -> Any:
            logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return F.cross_entropy(logits.float(), batch["labels"])

        return run

    return model, step


def gpt(hidden: int) -> tuple[nn.Module, Callable[[nn.Module], Step]]:
    model = GPTModel(
        GPTConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_attention_heads=HEADS,
            num_layers=LAYERS,
            max_position_embeddings=SEQ,
            dropout=0.0,
        )
    )

    def step(m: nn.Module) -> Step:
        def run(batch: dict[str, torch.Tensor]) -> Any:
            logits = m(batch["input_ids"])
            return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

        return run

    return model, step


def batch_for(name: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=generator)
    if name == "bert":
        return {
            "input_ids": ids[:, :-1],
            "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
            "labels": torch.randint(0, 4, (BATCH,), generator=generator),
        }
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def compose(name: str, hidden: int, ort: bool) -> tuple[RapidformerEngine, Step]:
    engine = RapidformerEngine(
        RapidformerConfig.from_dict({"lr": 1e-3, "lr_decay_style": "constant"})
    )
    torch.manual_seed(0)
    model, make_step = (bert if name == "bert" else gpt)(hidden)
    state = engine.compose(model)
    step = make_step(state.model)
    if ort:
        ort_step = OrtTrainStep(step, state.unwrapped_model, seed=0)
        # The fused optimizer updates the parameters in place without bumping their version
        # counters: ORT copies them in again before the next step's forward.
        assert state.optimizer is not None
        state.optimizer.register_step_post_hook(lambda *_: ort_step.parameters_changed())
        step = ort_step
    return engine, step


def train_steps(
    engine: RapidformerEngine, step: Step, batch: dict[str, torch.Tensor], steps: int
) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(step(batch))
        result = engine.step()
        assert result is not None
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
    return times, losses


def main() -> None:
    parser = argument_parser(__doc__, "hidden 32, 1 round of 3 steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per engine per round")
    parser.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, rounds, steps = (32, 1, 3) if args.quick else (HIDDEN, args.rounds, args.steps)
    rows: dict[str, dict[str, Any]] = {}
    for name in ("bert", "gpt"):
        batch = batch_for(name)
        eager_engine, eager_step = compose(name, hidden, ort=False)
        ort_engine, ort_step = compose(name, hidden, ort=True)
        first, ort_losses = train_steps(ort_engine, ort_step, batch, 2)  # export + build
        _, eager_losses = train_steps(eager_engine, eager_step, batch, 2)
        times: dict[str, list[float]] = {"eager": [], "ort": []}
        for r in range(rounds):
            t, losses = train_steps(eager_engine, eager_step, batch, steps)
            times["eager"] += t
            eager_losses += losses
            t, losses = train_steps(ort_engine, ort_step, batch, steps)
            times["ort"] += t
            ort_losses += losses
            print(
                f"{name} round {r + 1}/{rounds} eager {statistics.median(times['eager']) * 1e3:.1f}"
                f" ms  ort {statistics.median(times['ort']) * 1e3:.1f} ms"
            )
        median_ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        parity = max(abs(a - b) / abs(a) for a, b in zip(eager_losses, ort_losses, strict=True))
        parameters = sum(p.numel() for p in ort_engine.state.model.parameters())  # type: ignore[union-attr]
        rows[name] = {
            "parameters": parameters,
            "first_ort_step_s": first[0],
            "median_step_ms": median_ms,
            "ort_over_eager_time": median_ms["ort"] / median_ms["eager"],
            "max_rel_loss_diff": parity,
            "times_s": times,
        }
        print(
            f"{name}: first ORT step {first[0]:.2f} s; ORT/eager step time "
            f"{rows[name]['ort_over_eager_time']:.2f}; max relative loss diff {parity:.1e}"
        )
    if args.quick:
        return
    result = stamp(
        {
            "device": "cpu",
            "onnxruntime_training": ort_version(),
            "shape": {"hidden": hidden, "layers": LAYERS, "heads": HEADS, "batch": BATCH,
                      "seq": SEQ, "vocab": VOCAB},
            "threads": args.threads,
            "rounds": rounds,
            "steps_per_round": steps,
            "models": rows,
        }
    )  # fmt: skip
    labels = {"bert": "BertForSequenceClassification (HF)", "gpt": "built-in GPT"}
    write_results("onnxruntime_cpu", result, [
        "# ONNX Runtime training vs eager torch (CPU)",
        "",
        f"hidden {hidden}, {LAYERS} layers, {HEADS} heads, vocabulary {VOCAB}, dropout 0; batch "
        f"{BATCH} x {SEQ} tokens; a step is forward, backward (ORT: onnxruntime-training "
        f"{ort_version()} training API, gradients copied to torch), clipping and fused AdamW "
        f"through RapidformerEngine. {args.threads} intra-op thread(s) for torch and ORT; "
        f"{rounds} interleaved rounds of {steps} steps each; medians.",
        "",
        "| model | parameters | eager step (ms) | ORT step (ms) | ORT / eager time | first ORT "
        "step (export + build, s) | max relative loss diff |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {labels[name]} | {row['parameters']:,} | {row['median_step_ms']['eager']:.1f} | "
            f"{row['median_step_ms']['ort']:.1f} | **{row['ort_over_eager_time']:.2f}** | "
            f"{row['first_ort_step_s']:.1f} | {row['max_rel_loss_diff']:.1e} |"
            for name, row in rows.items()
        ),
        "",
        "A ratio above 1 means ORT is slower. Both engines see the same batches and start from the "
        "same weights, so their losses agree step by step (last column).",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
