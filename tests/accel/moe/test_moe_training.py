"""MoE through the engine on one process: the auxiliary losses under accumulation and in
hand-written loops, balancing, the logged dropped fraction, upcycling, and the flags' rules.

Numbers compared: router gradients of 4 accumulated micro-batches against one big batch
(<= 1e-6), the dropped fraction logged against a count made here, the load imbalance after
200 steps with and without balancing, and upcycled logits against the dense model's (<= 1e-6).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine, Trainer
from rapidformer.accel.moe.rules import moe_layer_indices
from rapidformer.checkpoint import find_checkpoint, save_checkpoint
from rapidformer.checkpoint.upcycle import load_upcycled
from rapidformer.engine import validate
from rapidformer.errors import ConfigError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.models.moe import MoELayer, moe_layers
from rapidformer.models.moe_router import route
from rapidformer.state import TrainState
from rapidformer.step_io import StepFunctions
from rapidformer.templates.trainer import DataBundle
from rapidformer.testing import MarkovLMDataset, lm_tokens, pad_collate
from tests.helpers.steppers import Capturing

GPT = GPTConfig(
    vocab_size=64,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=16,
    dropout=0.0,
)
TOLERANCE = 1e-6


def gpt_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def batches(count: int, size: int, seed: int, full: bool = True) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``size`` sequences (all 16 tokens when ``full``)."""
    data = MarkovLMDataset(
        count * size, vocab_size=64, min_length=16 if full else 4, max_length=16, seed=seed
    )
    samples = [data[i] for i in range(count * size)]
    return [pad_collate(samples[i : i + size], 16) for i in range(0, len(samples), size)]


def engine_for(micro: int, global_: int, **moe: Any) -> tuple[RapidformerEngine, TrainState]:
    config = RapidformerConfig.from_dict(
        {
            "micro_batch_size": micro,
            "global_batch_size": global_,
            "lr": 1e-3,
            "seed": 3,
            "num_experts": 4,
            **moe,
        }
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    return engine, engine.compose(GPTModel.build(GPT, "meta", seed=3))


def _router_grads(
    micro: int, aux_only: bool, data: list[dict[str, torch.Tensor]] | None = None, **moe: Any
) -> dict[str, torch.Tensor]:
    engine, state = engine_for(micro, 8, **moe)
    captured = Capturing()
    state.stepper = captured
    data = data or [b for b in batches(4, 2, seed=11)]
    merged = [{k: torch.cat([b[k] for b in data]) for k in data[0]}] if micro == 8 else data

    def loss(b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = state.model(b["input_ids"])
        return logits.sum() * 0.0 if aux_only else gpt_loss(logits, b)

    engine.run_step(merged, StepFunctions(train_step=loss, weight=lm_tokens))
    return {k: v for k, v in captured.grads.items() if "router" in k}


@pytest.mark.parametrize("aux_only", [True, False], ids=["aux-only", "with-lm-loss"])
def test_accumulated_micro_batches_give_the_big_batch_router_gradient(aux_only: bool) -> None:
    # seq_aux_loss is a mean over sequences: 4 micro-batches of 2 = one batch of 8, exactly.
    options = {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1}
    accumulated = _router_grads(2, aux_only, **options)
    whole = _router_grads(8, aux_only, **options)
    assert set(accumulated) == {f"blocks.{i}.ffn.router.gate.weight" for i in range(2)}
    for name, grad in accumulated.items():
        assert (grad - whole[name]).abs().max() <= TOLERANCE, name
        assert grad.abs().max() > 1e-5, name  # the auxiliary loss did reach it


@pytest.mark.parametrize("aux_only", [True, False], ids=["aux-only", "with-lm-loss"])
def test_global_aux_loss_of_micro_batches_is_aux_loss_of_the_concatenated_batch(
    aux_only: bool,
) -> None:
    # f_i counted over the whole step first: micro-batches of 1, 2, 2 and 3 sequences of
    # uneven lengths (so a micro-batch's share of the tokens the router sees differs from its
    # share of the loss's tokens) get the router gradient of aux_loss (E sum_i f_i P_i) taken
    # over the one batch of 8 they form.
    data = MarkovLMDataset(8, vocab_size=64, min_length=4, max_length=16, seed=11)
    samples = [data[i] for i in range(8)]
    uneven = [pad_collate(samples[a:b], 16) for a, b in ((0, 1), (1, 3), (3, 5), (5, 8))]
    options: dict[str, Any] = {"moe_aux_loss_coeff": 0.1}
    accumulated = _router_grads(
        2, aux_only, uneven, moe_router_load_balancing_type="global_aux_loss", **options
    )
    whole = _router_grads(8, aux_only, uneven, **options)
    per_micro_batch = _router_grads(2, aux_only, uneven, **options)
    assert set(accumulated) == {f"blocks.{i}.ffn.router.gate.weight" for i in range(2)}
    for name, grad in accumulated.items():
        assert (grad - whole[name]).abs().max() <= TOLERANCE, name
        assert (grad - per_micro_batch[name]).abs().max() > 100 * TOLERANCE, name  # not aux_loss


def test_global_aux_loss_counting_pass_leaves_the_dropout_masks_alone() -> None:
    # The pass runs every forward once more: with the random state put back, the training
    # forwards draw the masks they would draw without it (the loss is the LM loss alone).
    first = {}
    for balancing in ("global_aux_loss", "none"):
        config = RapidformerConfig.from_dict(
            {
                "micro_batch_size": 2,
                "global_batch_size": 4,
                "lr": 1e-3,
                "seed": 3,
                "num_experts": 4,
                "moe_router_load_balancing_type": balancing,
            }
        )
        engine = RapidformerEngine(config, builds_optimizer=True)
        model = GPTModel.build(dataclasses.replace(GPT, dropout=0.3), "meta", seed=3)
        state = engine.compose(model)
        step = StepFunctions(
            train_step=lambda b, s=state: gpt_loss(s.model(b["input_ids"]), b), weight=lm_tokens
        )
        torch.manual_seed(0)  # the masks' random state, the same for both runs
        first[balancing] = engine.run_step(batches(2, 2, seed=4), step).loss
    assert first["global_aux_loss"] == first["none"]


def test_global_aux_loss_needs_run_step_and_no_pipeline() -> None:
    engine, state = engine_for(2, 4, moe_router_load_balancing_type="global_aux_loss")
    batch = batches(1, 2, seed=5)[0]
    step = StepFunctions(
        train_step=lambda b: gpt_loss(state.model(b["input_ids"]), b), weight=lm_tokens
    )
    engine.run_step([batch, batch], step)  # counted first: trains
    # A hand-written step gets no counting pass, and must not reuse the last step's counts.
    with pytest.raises(RuntimeError, match="counts the routing of the whole step"):
        engine.backward(gpt_loss(state.model(batch["input_ids"]), batch))
    config = RapidformerConfig.from_dict(
        {
            "num_experts": 4,
            "num_layers": 2,
            "moe_router_load_balancing_type": "global_aux_loss",
            "pipeline_model_parallel_size": 2,
        }
    )
    with pytest.raises(ConfigError, match="a pipeline schedule") as refused:
        validate(config, world_size=2)
    assert "--moe-router-load-balancing-type='global_aux_loss'" in str(refused.value)


def test_batch_aux_loss_counts_once_per_micro_batch() -> None:
    # aux_loss is taken per micro-batch (Megatron's choice): the accumulated gradient is the
    # mean of the four micro-batches' own gradients, each computed here separately.
    engine, state = engine_for(2, 8, moe_aux_loss_coeff=0.1)
    reference = copy.deepcopy(state.unwrapped_model)
    captured = Capturing()
    state.stepper = captured
    data = batches(4, 2, seed=12)
    step = StepFunctions(
        train_step=lambda b: state.model(b["input_ids"]).sum() * 0.0, weight=lm_tokens
    )
    engine.run_step(data, step)
    expected: dict[str, torch.Tensor] = {}
    for batch in data:
        reference.zero_grad()
        reference(batch["input_ids"]).sum().mul(0.0).backward()  # attached losses, weight 1
        for name, param in reference.named_parameters():
            if "router" in name:
                expected[name] = expected.get(name, 0) + param.grad / len(data)
    for name, grad in expected.items():
        assert (captured.grads[name] - grad).abs().max() <= TOLERANCE, name


def test_a_hand_written_loop_weights_the_auxiliary_loss_like_run_step() -> None:
    options = {"moe_aux_loss_coeff": 0.1}
    data = batches(4, 2, seed=13, full=False)  # uneven token counts: the late rescale acts
    grads = []
    for hand_written in (False, True):
        engine, state = engine_for(2, 8, **options)
        captured = Capturing()
        state.stepper = captured
        if hand_written:
            for batch in data:
                loss = gpt_loss(state.model(batch["input_ids"]), batch)
                engine.backward(loss, weight=lm_tokens(batch))
            engine.step()
        else:
            step = StepFunctions(
                train_step=lambda b, model=state.model: gpt_loss(model(b["input_ids"]), b),
                weight=lm_tokens,
            )
            engine.run_step(data, step)
        grads.append(captured.grads)
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).abs().max() <= TOLERANCE, name


# ---- balancing -----------------------------------------------------------------------------
def _crowd(state: TrainState) -> None:
    """Make every token prefer experts 0 and 1: the FFN input gets a constant component along
    ``u`` (the LayerNorm bias) and those experts' router rows point along it."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in state.unwrapped_model.blocks.values():
            u = torch.randn(GPT.hidden_size, generator=generator)
            u = u / u.norm()
            block.ffn_norm.bias.copy_(2.0 * u)
            block.ffn.router.gate.weight[:2] += 3.0 * u


def _imbalance_after(balancing: str, steps: int = 200) -> float:
    options: dict[str, Any] = {"moe_router_load_balancing_type": balancing}
    if balancing == "aux_loss":
        options["moe_aux_loss_coeff"] = 0.1
    if balancing == "expert_bias":
        options["moe_router_bias_update_rate"] = 0.01
    engine, state = engine_for(8, 8, **options)
    _crowd(state)
    step = StepFunctions(
        train_step=lambda b: gpt_loss(state.model(b["input_ids"]), b), weight=lm_tokens
    )
    for index in range(steps):
        if index == steps - 20:
            engine.routing_metrics()  # the figure is the last 20 steps'
        engine.run_step(batches(1, 8, seed=1000 + index), step)
    return float(engine.routing_metrics()["moe_load_imbalance"])


def test_balancing_lowers_the_load_imbalance_of_a_crowded_router() -> None:
    figures = {kind: _imbalance_after(kind) for kind in ("none", "aux_loss", "expert_bias")}
    print("load imbalance after 200 steps:", figures)
    assert figures["none"] > 1.6  # the crowding holds without balancing
    assert figures["aux_loss"] < figures["none"] - 0.2
    assert figures["expert_bias"] < figures["none"] - 0.2


def test_the_logged_dropped_fraction_is_the_counted_one() -> None:
    engine, state = engine_for(2, 8, moe_expert_capacity_factor=1.0)
    _crowd(state)  # crowded routing overflows the capacity
    expected = [0, 0]  # dropped, assigned

    def count(module: torch.nn.Module, inputs: Any, logits: torch.Tensor) -> None:
        layer = next(m for m in moe_layers([state.unwrapped_model]) if m.router is module)
        routing = route(logits, layer.topk, layer.score)
        capacity = math.ceil(1.0 * logits.shape[0] * layer.topk / layer.num_experts)
        expected[0] += int(sum(max(0, int(c) - capacity) for c in routing.counts))
        expected[1] += routing.experts.numel()

    for layer in moe_layers([state.unwrapped_model]):
        layer.router.register_forward_hook(count)
    step = StepFunctions(
        train_step=lambda b: gpt_loss(state.model(b["input_ids"]), b), weight=lm_tokens
    )
    engine.run_step(batches(4, 2, seed=14), step)
    logged = engine.routing_metrics()["moe_dropped_fraction"]
    assert expected[0] > 0
    assert logged == pytest.approx(expected[0] / expected[1], abs=1e-9)


# ---- upcycling -----------------------------------------------------------------------------
def test_an_upcycled_model_computes_the_dense_logits_then_learns() -> None:
    dense = GPTModel.build(GPT, "cpu", seed=4)
    ids = batches(1, 4, seed=15)[0]["input_ids"]
    with torch.no_grad():
        expected = dense(ids)
    engine, _ = engine_for(4, 4)
    state = engine.compose(copy.deepcopy(dense))  # materialised: upcycled in place
    assert any("upcycled from the dense FFNs" in str(p) for p in state.plan)
    with torch.no_grad():
        got = state.model(ids)
    assert (got - expected).abs().max() <= TOLERANCE
    step = StepFunctions(
        train_step=lambda b: gpt_loss(state.model(b["input_ids"]), b), weight=lm_tokens
    )
    data = batches(1, 4, seed=16)
    losses = [engine.run_step(data, step).loss for _ in range(20)]
    assert losses[-1] < losses[0] - 0.1


class _GPTTrainer(Trainer):
    """The built-in GPT on Markov sequences, for the --load / --moe-use-upcycling path."""

    def build_model(self) -> torch.nn.Module:
        return GPTModel.build(GPT, "meta", seed=self.config.training.seed)

    def build_data(self) -> DataBundle:
        data = MarkovLMDataset(64, vocab_size=64, min_length=16, max_length=16, seed=1)
        return DataBundle(train=data, collate_fn=lambda s: pad_collate(s, 16))

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        return gpt_loss(self.model(batch["input_ids"]), batch)

    def batch_weight(self, batch: Any) -> Any:
        return lm_tokens(batch)


def test_upcycling_a_dense_checkpoint_through_load(tmp_path: Path) -> None:
    common = ["--micro-batch-size", "4", "--lr", "1e-3", "--train-iters", "3", "--seed", "9"]
    _GPTTrainer(argv=[*common, "--save", str(tmp_path / "dense")]).fit()
    moe = _GPTTrainer(
        argv=[
            *common,
            "--num-experts",
            "4",
            "--moe-use-upcycling",
            "--load",
            str(tmp_path / "dense"),
            "--save",
            str(tmp_path / "moe"),
        ]
    )
    seen: list[tuple[dict[str, torch.Tensor], float]] = []
    original = moe.train_step

    def train_step(batch: Any) -> torch.Tensor:
        loss = original(batch)
        seen.append((batch, float(loss)))
        return loss

    moe.train_step = train_step  # type: ignore[method-assign]
    moe.fit()
    # A fresh run (3 steps from step 0) whose first loss is the dense checkpoint's on the
    # same batch: dropless top-2 over identical experts is the dense FFN.
    assert len(seen) == 3
    path = find_checkpoint(str(tmp_path / "dense"))
    assert path is not None
    dense = GPTModel.build(GPT, "cpu", seed=0)
    dense.load_state_dict(torch.load(path / "model.pt"))
    batch, first_loss = seen[0]
    with torch.no_grad():
        expected = float(gpt_loss(dense(batch["input_ids"]), batch))
    assert abs(first_loss - expected) <= TOLERANCE
    # Its log line carries the routing statistics (console, metrics.jsonl, TensorBoard).
    rows = [
        json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in rows if r["kind"] == "train"]
    assert train and train[-1]["moe_dropped_fraction"] == 0.0  # dropless
    assert train[-1]["moe_load_imbalance"] >= 1.0
    assert len(train[-1]["moe_load_imbalance_per_layer"]) == GPT.num_layers
    assert 0.0 < train[-1]["moe_aux_loss"] < 0.1  # 1e-2 x ~1 per layer, 2 layers
    # A second run resumes the upcycled run from its own --save, not from the dense one.
    again = _GPTTrainer(
        argv=[
            *common,
            "--train-iters",
            "4",
            "--num-experts",
            "4",
            "--moe-use-upcycling",
            "--load",
            str(tmp_path / "dense"),
            "--save",
            str(tmp_path / "moe"),
        ]
    )
    steps: list[int] = []
    original_log = again._log_step
    again._log_step = lambda logger, step, *rest: (  # type: ignore[method-assign]
        steps.append(step),
        original_log(logger, step, *rest),
    )[1]
    again.fit()
    assert steps == [4]


def test_upcycling_loads_dense_weights_into_an_moe_state(tmp_path: Path) -> None:
    _, dense_state = engine_for(4, 4)
    dense = GPTModel.build(GPT, "cpu", seed=4)
    config = RapidformerConfig.from_dict({"micro_batch_size": 4, "lr": 1e-3})
    dense_engine = RapidformerEngine(config, builds_optimizer=True)
    saved = dense_engine.compose(dense)
    save_checkpoint(str(tmp_path), 3, saved, {"step": 3})
    path = find_checkpoint(str(tmp_path))
    assert path is not None
    load_upcycled(dense_state, path)
    ids = batches(1, 4, seed=17)[0]["input_ids"]
    with torch.no_grad():
        assert (dense_state.model(ids) - dense(ids)).abs().max() <= TOLERANCE
    assert isinstance(dense_state.unwrapped_model.blocks["0"].ffn, MoELayer)


def test_bert_takes_moe_layers_too() -> None:
    from rapidformer.models.bert import BertConfig, BertModel

    config = RapidformerConfig.from_dict(
        {"micro_batch_size": 2, "lr": 1e-3, "num_experts": 4, "moe_layer_freq": "[0,1]"}
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    bert = BertConfig(
        vocab_size=64,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=16,
        dropout=0.0,
    )
    state = engine.compose(BertModel.build(bert, "meta", seed=2))
    blocks = state.unwrapped_model.blocks
    assert not isinstance(blocks["0"].ffn, MoELayer) and isinstance(blocks["1"].ffn, MoELayer)
    assert blocks["1"].ffn.experts.approximate == "none"  # BERT's erf GELU, as its dense FFN
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = state.model(ids)
    mlm = out[0] if isinstance(out, tuple) else out
    mlm.float().square().mean().backward()
    assert blocks["1"].ffn.experts.w1.grad.abs().sum() > 0
    assert any("experts on this rank" in str(p) for p in state.plan)


def test_compiled_moe_blocks_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropless routing's data-dependent shapes through dynamo and AOT autograd (inductor's
    kernels are checked on dense blocks in tests/accel/compile: here every new token count per
    expert would cost a cold C++ build)."""
    from rapidformer.accel.compile import apply as compile_apply
    from tests.helpers.parity import train_gpt

    monkeypatch.setattr(compile_apply, "BACKEND", "aot_eager")
    # Each expert's new row count recompiles its split until dynamo's limit sends that frame
    # back to eager (as in a real run): a limit of 2 reaches both states in a quarter the time.
    # (dynamo's own patch: monkeypatch's undo deletes a config entry it did not find in
    # the module's __dict__, and every later compile in the process then fails.)
    eager = train_gpt({"num_experts": 4}, steps=3)
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled = train_gpt({"num_experts": 4, "torch_compile": True}, steps=3)
    assert max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True)) <= 1e-5


# ---- flags ---------------------------------------------------------------------------------
def test_layer_frequency_forms() -> None:
    assert moe_layer_indices("1", 4) == (0, 1, 2, 3)
    assert moe_layer_indices("2", 4) == (0, 2)
    assert moe_layer_indices("[0,1,1,0]", 4) == (1, 2)
    assert moe_layer_indices("0101", 4) == (1, 3)
    with pytest.raises(ValueError, match="4 layers"):
        moe_layer_indices("[1,0]", 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"num_experts": 4, "moe_router_topk": 5}, "--moe-router-topk=5: must lie in [1"),
        ({"num_experts": 4, "expert_model_parallel_size": 3}, "must divide --num-experts 4"),
        ({"moe_router_topk": 1}, "--moe-router-topk=1: has no effect without --num-experts"),
        ({"num_experts": 4, "moe_token_drop_policy": "position"}, "dropless"),
        ({"num_experts": 4, "moe_expert_capacity_factor": 0.0}, "must be positive"),
        ({"num_experts": 4, "zero_backend": "deepspeed"}, "not run by the DeepSpeed engine"),
        ({"num_experts": 4, "moe_use_upcycling": True}, "--moe-use-upcycling=True: needs the"),
        (
            {"num_experts": 4, "tensor_model_parallel_size": 2, "sequence_parallel": True},
            "--num-experts=4: cannot run with --sequence-parallel",
        ),
        (
            {"num_experts": 4, "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.1},
            "has no effect with --moe-router-load-balancing-type none",
        ),
    ],
)
def test_bad_moe_flags_are_refused_before_anything_is_built(
    flags: dict[str, Any], message: str
) -> None:
    config = RapidformerConfig.from_dict({"micro_batch_size": 2, **flags})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        RapidformerEngine(config)


def test_num_experts_needs_a_model_with_ffn_slots() -> None:
    config = RapidformerConfig.from_dict({"micro_batch_size": 2, "num_experts": 4})
    engine = RapidformerEngine(config)
    with pytest.raises(ConfigError, match="--num-experts=4: needs a model with MoE-ready FFN"):
        engine.compose(torch.nn.Linear(4, 4))
