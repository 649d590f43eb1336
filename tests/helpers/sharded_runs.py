"""Ten AdamW steps of a tiny LM through ``run_step`` on one rank or several, recording the
losses and the bytes each rank holds: the single-process reference and the sharded runs the
sharding and DeepSpeed tests compare with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.memory import measured_bytes
from rapidformer.step_io import StepFunctions
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, lm_tokens, pad_collate
from tests.helpers.steppers import MeasuringBytes

TOLERANCE = 1e-5
STEPS, GLOBAL = 10, 8


def tiny_lm() -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=64)


class HFCausalLM(torch.nn.Module):
    """A tiny transformers GPT-2 returning logits, like the built-in model."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.gpt2 = transformers.GPT2LMHeadModel(config)
        self._no_split_modules = self.gpt2._no_split_modules  # the layer classes FSDP2 shards

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=input_ids).logits


def train_tiny_lm(flag: str | None, out: str, micro: int = 2, **extra: Any) -> None:
    """10 AdamW steps of a global batch of 8 (uneven lengths, token-weighted, clipped) through
    ``run_step``; this rank's losses and held bytes go to ``out``/rank_R.json."""
    torch.set_num_threads(1)
    options: dict[str, Any] = {
        "micro_batch_size": micro,
        "global_batch_size": GLOBAL,
        "lr": 3e-3,
        "clip_grad": 1.0,
    }
    if flag is not None:  # --name (a switch) or --name=value
        name, _, value = flag.removeprefix("--").partition("=")
        options[name.replace("-", "_")] = value or True
    hf = extra.pop("hf", False)
    user_optimizer = extra.pop("user_optimizer", False)
    options.update(extra)
    engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
    model = HFCausalLM() if hf else tiny_lm()
    # A user's optimizer is built on the parameters FSDP2 then replaces: compose() rebinds it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3) if user_optimizer else None
    state = engine.compose(model, optimizer=optimizer)
    rank, dp = engine.env.rank, engine.dims.dp
    expected, ddp = state.stepper.expected_bytes(state)  # the report compose() logs
    measuring = MeasuringBytes(state)
    state.stepper = measuring
    dataset = MarkovLMDataset(STEPS * GLOBAL, vocab_size=64, min_length=4, max_length=40, seed=3)
    per_rank = GLOBAL // dp
    in_forward: list[int] = []

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = lm_loss(state.model, batch)["loss"]
        if not in_forward:  # the first forward: what this rank holds between it and backward
            in_forward.append(measured_bytes(state.model, None).parameters)
        return loss

    step = StepFunctions(train_step=loss_of, weight=lm_tokens)
    losses: list[float] = []
    for index in range(STEPS):
        mine = [dataset[index * GLOBAL + rank * per_rank + i] for i in range(per_rank)]
        batches = [pad_collate(mine[i : i + micro]) for i in range(0, per_rank, micro)]
        losses.append(engine.run_step(batches, step).loss)
    held = {**measuring.held, "parameters_in_forward": in_forward[0]}
    record = {
        "losses": losses,
        "held": held,
        "expected": [expected.parameters, expected.gradients, expected.optimizer],
        "ddp": [ddp.parameters, ddp.gradients, ddp.optimizer],
        "plan": [str(p) for p in state.plan],
    }
    (Path(out) / f"rank_{rank}.json").write_text(json.dumps(record))
    engine.close()


def reference_run(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    out = tmp_path / "single"
    out.mkdir()
    train_tiny_lm(None, str(out), micro=4, **extra)
    return json.loads((out / "rank_0.json").read_text())
