"""Megatron's recompute flags: selective recomputation keeps the numbers and recomputes
pointwise ops but no matmul; full recomputation repeats the matmuls; --recompute-method block
recomputes exactly the first N layers and uniform chunks N layers into one checkpoint; bad
combinations are refused before anything is built."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.errors import ConfigError
from rapidformer.models.blocks import find_blocks
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from tests.helpers.trainers import read_losses, tiny_trainer

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
PARITY = 1e-6


class OpCounts(TorchDispatchMode):
    """Counts every aten op run below autograd (forward, backward and recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def total(self, ops: set[Any]) -> int:
        return sum(self.counts[op] for op in ops)


def _batch() -> dict[str, torch.Tensor]:
    data = MarkovLMDataset(8, min_length=32, max_length=32, seed=6)
    return pad_collate([data[i] for i in range(8)])


def _tiny() -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(hidden=64, layers=4, heads=4, max_positions=64, dropout=0.1)


def _step(
    options: dict[str, Any],
    model: nn.Module | None = None,
    loss_fn: Callable[..., dict[str, torch.Tensor]] = lm_loss,
    batch: dict[str, torch.Tensor] | None = None,
    before: Callable[[nn.Module], None] | None = None,
) -> tuple[float, dict[str, torch.Tensor], OpCounts, list[str]]:
    """One forward and backward under the flags: loss, gradients, the ops that ran, plan."""
    model = model if model is not None else _tiny()
    if before is not None:
        before(model)
    engine = RapidformerEngine(RapidformerConfig.from_dict(options))
    state = engine.compose(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    torch.manual_seed(1)  # the same dropout masks in every mode (recompute replays the RNG)
    with OpCounts() as ops:
        loss = loss_fn(state.model, batch if batch is not None else _batch())["loss"]
        engine.backward(loss)
    grads = {n: p.grad.clone() for n, p in state.unwrapped_model.named_parameters()}
    engine.close()
    return loss.item(), grads, ops, [str(p) for p in state.plan]


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_selective_recomputes_pointwise_ops_and_no_matmul_full_repeats_the_matmuls() -> None:
    plain_loss, plain_grads, plain_ops, _ = _step({})
    loss, grads, ops, plan = _step({"recompute_granularity": "selective"})
    assert any("selective recompute" in p and "saves matmul and attention" in p for p in plan)
    assert loss == plain_loss and _max_gap(grads, plain_grads) <= PARITY
    assert ops.total(MATMULS) == plain_ops.total(MATMULS)  # no matmul ran twice
    pointwise = {aten.gelu.default, aten.native_layer_norm.default}
    assert ops.total(pointwise) > plain_ops.total(pointwise)  # recomputed in backward
    _, full_grads, full_ops, _ = _step({"recompute_granularity": "full"})
    assert _max_gap(full_grads, plain_grads) <= PARITY
    # Full recomputation runs every block's forward matmuls again: 4 layers x (qkv, out, fc1,
    # fc2) at least.
    assert full_ops.total(MATMULS) >= plain_ops.total(MATMULS) + 16


def _count_forwards(calls: Counter[int]) -> Callable[[nn.Module], None]:
    """Wrap each block's forward to count its runs (before the recompute patch wraps it)."""

    def install(model: nn.Module) -> None:
        for index, block in enumerate(find_blocks(model)):
            original = block.forward

            def counted(*args: Any, _i: int = index, _f: Any = original, **kw: Any) -> Any:
                calls[_i] += 1
                return _f(*args, **kw)

            block.forward = counted  # type: ignore[method-assign]

    return install


@pytest.mark.parametrize(
    ("method", "runs", "plan_text"),
    [
        # block 2: layers 0 and 1 run again in backward, 2 and 3 keep everything
        ("block", {0: 2, 1: 2, 2: 1, 3: 1}, "2 of 4 layers x Block"),
        # uniform 2: every layer recomputed once, two layers per checkpoint
        ("uniform", {0: 2, 1: 2, 2: 2, 3: 2}, "4 layers in chunks of 2"),
    ],
)
def test_the_method_chooses_which_layers_recompute(
    method: str, runs: dict[int, int], plan_text: str
) -> None:
    calls: Counter[int] = Counter()
    options = {
        "recompute_granularity": "full",
        "recompute_method": method,
        "recompute_num_layers": 2,
    }
    _, plain_grads, _, _ = _step({})
    _, grads, _, plan = _step(options, before=_count_forwards(calls))
    assert calls == Counter(runs), calls
    assert any(plan_text in p for p in plan), plan
    assert _max_gap(grads, plain_grads) <= PARITY


def test_a_hugging_face_llama_recomputes_selectively_and_in_chunks() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": model(input_ids=batch["ids"], labels=batch["ids"]).loss}

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    batch = {"ids": ids}
    plain_loss, plain_grads, plain_ops, _ = _step({}, llama(), loss, batch)
    chunked = {"recompute_method": "uniform", "recompute_num_layers": 2}
    for options in (
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "full", **chunked},
    ):
        value, grads, ops, plan = _step(options, llama(), loss, batch)
        assert any("LlamaDecoderLayer" in p for p in plan), plan
        assert abs(value - plain_loss) <= 1e-6 and _max_gap(grads, plain_grads) <= 1e-5
        if options["recompute_granularity"] == "selective":
            assert ops.total(MATMULS) == plain_ops.total(MATMULS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"checkpoint_activations": True, "recompute_granularity": "selective"},
            "--checkpoint-activations",
        ),
        ({"recompute_method": "block", "recompute_num_layers": 1}, "needs --recompute-granularity"),
        (
            {"recompute_granularity": "full", "recompute_method": "block"},
            "needs --recompute-num-layers",
        ),
        ({"recompute_granularity": "full", "recompute_num_layers": 2}, "needs --recompute-method"),
        (
            {
                "recompute_granularity": "selective",
                "recompute_method": "uniform",
                "recompute_num_layers": 2,
            },
            "applies to full recomputation only",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 0,
            },
            "at least 1",
        ),
    ],
)
def test_bad_combinations_are_refused_before_anything_is_built(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RapidformerEngine(RapidformerConfig.from_dict(options))


def test_more_layers_than_the_model_has_is_refused_at_compose() -> None:
    options = {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 5,
    }
    with pytest.raises(ConfigError, match="exceeds the 4 layers"):
        _step(options)


def test_selective_keeps_the_black_box_loss_curve(tmp_path: Path) -> None:
    flags = ("--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "8")
    tiny_trainer(*flags, "--save", str(tmp_path / "plain")).fit()
    tiny_trainer(
        *flags, "--save", str(tmp_path / "selective"), "--recompute-granularity", "selective"
    ).fit()
    plain, selective = read_losses(tmp_path / "plain"), read_losses(tmp_path / "selective")
    assert set(plain) == set(selective) == set(range(1, 7))
    assert max(abs(plain[s] - selective[s]) for s in plain) <= PARITY
