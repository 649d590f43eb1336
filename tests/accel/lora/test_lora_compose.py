"""Adapters with the other switches: compiled per block (one block graph per shape, no
fallback, eager's numbers), on float8 linear layers (torchao, emulated on the CPU) with
selective recomputation and compile, and with full or selective recomputation and the fused LM
loss (the loss curve of plain LoRA, within 1e-5 in fp32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from rapidformer import Finetuner, RapidformerConfig, RapidformerEngine, StepFunctions, parse_args
from rapidformer.accel.compile import apply as compile_module
from rapidformer.accel.lora.layer import adapted_layers
from rapidformer.testing.finetune import task_dataset, tiny_model
from rapidformer.testing.tiny import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from tests.helpers.trainers import read_losses

TOLERANCE = 1e-5


@pytest.fixture
def eager_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Dynamo's graphs and guards, without generating kernels (as the compile tests do)."""
    monkeypatch.setattr(compile_module, "BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama(layers: int) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _losses(options: dict[str, object], model: nn.Module, lengths: list[int]) -> tuple:
    engine = RapidformerEngine(RapidformerConfig.from_dict({"lr": 1e-2, **options}))
    state = engine.compose(model)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return state.model(input_ids=ids, labels=ids).loss

    step = StepFunctions(train_step=loss, weight=lambda ids: ids.numel())
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, n), generator=generator) for n in lengths]
    losses = [engine.run_step([b], step).loss for b in batches]
    metrics = engine.step_metrics()
    engine.close()
    return losses, metrics, state


def test_a_ten_layer_llama_with_adapters_compiles_one_block_graph_per_shape(
    eager_backend: None,
) -> None:
    lengths = [8, 8, 12, 12]
    eager, _, _ = _losses({"lora_rank": 4, "lora_variant": "dora"}, _llama(10), lengths)
    torch._dynamo.reset()
    compiled, metrics, state = _losses(
        {"lora_rank": 4, "lora_variant": "dora", "torch_compile": True}, _llama(10), lengths
    )
    assert len(adapted_layers(state.unwrapped_model)) == 70
    assert metrics == {"compile_graphs": 2, "compile_fallbacks": 0}  # lengths 8 and 12
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) <= TOLERANCE
    assert compiled[-1] < compiled[0]


def test_adapters_sit_on_float8_layers_with_recompute_and_compile(
    eager_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rapidformer.accel import fp8

    monkeypatch.setattr(fp8, "EMULATE", True)
    data = MarkovLMDataset(24, min_length=32, max_length=32, seed=2)
    batches = [pad_collate([data[s * 4 + i] for i in range(4)]) for s in range(6)]
    curves = {}
    for precision in ("bf16", "fp8"):
        torch._dynamo.reset()
        options = {"precision": precision, "lr": 1e-2, "micro_batch_size": 4, "lora_rank": 8}
        options |= {"recompute_granularity": "selective", "torch_compile": True}
        engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
        torch.manual_seed(0)
        state = engine.compose(TinyTransformerLM(hidden=64, layers=2, heads=4, max_positions=64))
        layers = adapted_layers(state.unwrapped_model)
        kinds = {type(layer).__name__ for layer in layers.values()}
        assert kinds == ({"Float8Linear"} if precision == "fp8" else {"Linear"}), kinds
        functions = StepFunctions(
            train_step=lambda b, m=state.model: lm_loss(m, b)["loss"], weight=lambda b: 4
        )
        curves[precision] = [engine.run_step([b], functions).loss for b in batches]
        assert engine.step_metrics()["compile_fallbacks"] == 0
        engine.close()
    gap = max(abs(a - b) for a, b in zip(curves["fp8"], curves["bf16"], strict=True))
    assert gap <= 2e-2, curves  # the emulation bound of tests/accel/test_fp8.py
    assert curves["fp8"][-1] < curves["fp8"][0]


def test_recompute_and_the_fused_loss_keep_the_adapter_loss_curve(tmp_path: Path) -> None:
    model = tiny_model("llama", tmp_path / "llama")
    data = task_dataset("causal_lm", tmp_path / "data", train=32, validation=8)
    runs = {
        "plain": (),
        "full": ("--recompute-granularity", "full"),
        "selective": ("--recompute-granularity", "selective"),
        "fused": ("--fused-lm-loss",),
    }
    curves = {}
    for name, flags in runs.items():
        Finetuner(
            parse_args(
                [
                    *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model)),
                    *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "4"),
                    *("--lr", "1e-2", "--train-iters", "4", "--log-interval", "1"),
                    *("--lora-rank", "4", "--save", str(tmp_path / name), *flags),
                ]
            )
        ).fit()
        curves[name] = read_losses(tmp_path / name)
    for name in ("full", "selective", "fused"):
        gap = max(abs(curves[name][s] - curves["plain"][s]) for s in curves["plain"])
        assert gap <= TOLERANCE, (name, curves)


def test_frozen_linear_weights_kept_in_bf16_change_no_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under bf16 autocast every matmul casts its weight to bf16: storing the frozen linear
    weights so halves their memory and leaves the losses bit for bit."""
    from rapidformer.accel.lora import apply as lora_apply

    options = {"lora_rank": 4, "precision": "bf16"}
    stored, _, state = _losses(options, _llama(2), [16, 16, 16])
    frozen = [p for p in state.unwrapped_model.parameters() if not p.requires_grad]
    linear = [m.weight for m in state.unwrapped_model.modules() if isinstance(m, nn.Linear)]
    assert {p.dtype for p in linear} == {torch.bfloat16}
    assert {p.dtype for p in frozen if p.ndim == 1} == {torch.float32}  # the norms stay
    kept_bytes, _ = state.stepper.expected_bytes(state)
    monkeypatch.setattr(lora_apply, "store_frozen", lambda *args, **kwargs: None)
    unchanged, _, plain = _losses(options, _llama(2), [16, 16, 16])
    plain_bytes, _ = plain.stepper.expected_bytes(plain)
    assert stored == unchanged
    linear_bytes = sum(p.numel() for p in linear) * 2
    assert plain_bytes.parameters - kept_bytes.parameters == linear_bytes
