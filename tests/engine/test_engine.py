"""A hand-written loop driving RapidformerEngine gets the same training as the Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from rapidformer import RapidformerEngine
from rapidformer.schedules import build_lr_scheduler
from rapidformer.step_io import StepFunctions
from rapidformer.templates.trainer import seed_everything
from rapidformer.testing import lm_loss, lm_tokens
from tests.helpers.trainers import read_losses, tiny_trainer

FLAGS = (
    "--train-iters",
    "6",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr-warmup-iters",
    "2",
    "--checkpoint-activations",
)


LATE_WEIGHTS = 1e-6
"""backward(loss, weight)/step() learn the step's token count after the forwards and rescale
the accumulated gradients once; the Trainer counts first: the same losses up to rounding (a
different order of the same multiplications), not bitwise."""


def _hand_loop_losses(trainer: Any, late: bool) -> list[float]:
    config = trainer.config
    engine = RapidformerEngine(config)  # hand-written loop: neither --lr nor --train-iters needed
    seed_everything(config.training.seed)
    data = trainer.build_data()
    model = trainer.build_model()
    loader = DataLoader(data.train, batch_size=4, shuffle=True, collate_fn=data.collate_fn)
    state = engine.compose(
        model,
        train_dataloader=loader,
        lr_scheduler_fn=lambda opt: build_lr_scheduler(opt, config, 6),
    )
    assert any("activation checkpointing" in str(step) for step in state.plan)
    assert state.train_dataloader is not None
    step = StepFunctions(train_step=lambda b: lm_loss(state.model, b)["loss"], weight=lm_tokens)
    losses: list[float] = []
    group: list[Any] = []
    while len(losses) < 6:
        for batch in state.train_dataloader:
            if late:
                out = lm_loss(state.model, batch)
                engine.backward(out["loss"], weight=out["num_tokens"])
                result = engine.step()  # None on the first micro-batch of each step
            else:
                group.append(batch)
                result = engine.run_step(group, step) if len(group) == 2 else None
                group = [] if result is not None else group
            if result is not None:
                losses.append(result.loss)
            if len(losses) == 6:
                break
    return losses


def test_hand_written_loops_match_the_trainer(tmp_path: Path) -> None:
    trainer = tiny_trainer(*FLAGS, "--save", str(tmp_path))
    trainer.fit()
    expected = [read_losses(tmp_path)[step] for step in range(1, 7)]
    # run_step with the Trainer's own micro-step: the same computation, bitwise.
    assert _hand_loop_losses(trainer, late=False) == expected
    late = _hand_loop_losses(trainer, late=True)
    assert max(abs(a - b) for a, b in zip(late, expected, strict=True)) <= LATE_WEIGHTS


def test_step_before_the_last_micro_batch_does_nothing() -> None:
    trainer = tiny_trainer(
        "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "6"
    )
    engine = trainer.engine
    state = engine.compose(trainer.build_model())
    batch = next(
        iter(
            DataLoader(
                trainer.build_data().train, batch_size=2, collate_fn=trainer.build_data().collate_fn
            )
        )
    )
    before = {k: v.clone() for k, v in state.unwrapped_model.state_dict().items()}
    for micro_step in range(3):
        engine.backward(lm_loss(state.model, batch)["loss"])
        result = engine.step()
        assert (result is None) == (micro_step < 2)
    after = state.unwrapped_model.state_dict()
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_two_engines_of_one_seed_draw_the_same_dropout_masks() -> None:
    """``--seed`` seeds every generator, a hand-written loop's dropout included: whatever the
    process drew before, an engine of the same seed trains to the same losses (bitwise: the
    same computation repeated)."""
    import torch.nn.functional as F

    from rapidformer import RapidformerConfig
    from rapidformer.models.gpt import GPTConfig, GPTModel

    shape = GPTConfig(
        vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4,
        max_position_embeddings=16, dropout=0.1,
    )  # fmt: skip
    ids = torch.arange(34).remainder(128).view(2, 17)

    def losses(seed: int) -> list[float]:
        config = RapidformerConfig.from_dict(
            {"lr": 1e-3, "seq_length": 16, "micro_batch_size": 2, "seed": seed}
        )
        engine = RapidformerEngine(config, builds_optimizer=True)
        state = engine.compose(GPTModel.build(shape, "meta"))

        def loss(batch: torch.Tensor) -> torch.Tensor:
            logits = state.model(batch[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

        step = StepFunctions(train_step=loss, weight=lambda b: b.shape[0])
        out = [float(engine.run_step([ids], step).loss) for _ in range(3)]
        engine.close()
        return out

    first = losses(7)
    torch.randn(100)  # the process's generator moves on between the two runs
    assert losses(7) == first
    assert losses(8) != first  # the masks do depend on the seed
