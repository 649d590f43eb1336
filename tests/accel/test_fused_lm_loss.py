"""--fused-lm-loss: the head and cross-entropy in chunks equal the plain loss within 1e-5
(loss and every gradient), the built-in GPT and BERT pretrain on the same loss curve, and the
switch is refused where it cannot run."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine, parse_args
from rapidformer.errors import ConfigError
from rapidformer.models import bert as bert_module
from rapidformer.models import fused_loss
from rapidformer.models import gpt as gpt_module
from rapidformer.models.fused_loss import fused_linear_cross_entropy
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.testing import TinyTransformerLM
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents
from tests.helpers.trainers import read_losses

PARITY = 1e-5


def _inputs(bias: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    b = torch.randn(50, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (37,), generator=generator)
    targets[::5] = -100  # ignored positions (padding, unmasked tokens)
    return hidden, weight, b, targets  # type: ignore[return-value]


@pytest.mark.parametrize("bias", [False, True])
def test_chunks_equal_the_plain_loss_and_gradients(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 50 * 8)  # 8 tokens a chunk: 5 chunks
    hidden, weight, b, targets = _inputs(bias)
    plain = F.cross_entropy(F.linear(hidden, weight, b), targets, ignore_index=-100)
    plain.backward()
    expected = [t.grad.clone() for t in (hidden, weight, b) if t is not None]
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    fused = fused_linear_cross_entropy(hidden, weight, b, targets)
    fused.backward()
    assert abs(fused.item() - plain.item()) <= PARITY
    got = [t.grad for t in (hidden, weight, b) if t is not None]
    for a, e in zip(got, expected, strict=True):
        assert (a - e).abs().max().item() <= PARITY


def test_under_bf16_autocast_it_matches_the_plain_head_under_autocast() -> None:
    hidden, weight, _, targets = _inputs(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100)
        fused = fused_linear_cross_entropy(hidden, weight, None, targets)
    plain.backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    fused.backward()
    assert abs(fused.item() - plain.item()) <= 1e-2 * abs(plain.item())
    assert (hidden.grad - expected).abs().max().item() <= 1e-2


def test_liger_is_called_with_its_argument_order_where_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA with liger-kernel installed: LigerFusedLinearCrossEntropyLoss()(weight, hidden,
    targets, bias). Checked here with a stand-in module (no CUDA, no Liger on this machine)."""
    calls: list[tuple[Any, ...]] = []

    class Loss:
        def __init__(self, ignore_index: int) -> None:
            assert ignore_index == -100

        def __call__(self, *args: Any) -> torch.Tensor:
            calls.append(args)
            return torch.tensor(1.0)

    assert not fused_loss.liger_available(torch.device("cpu"))  # Triton: CUDA only
    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = Loss  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(fused_loss, "liger_available", lambda device: True)
    hidden, weight, b, targets = _inputs(True)
    assert fused_linear_cross_entropy(hidden, weight, b, targets).item() == 1.0
    ((w, h, t, bias),) = calls
    assert w is weight and h.shape == (37, 16) and t.shape == (37,) and bias is b


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PretrainingData]:
    documents = synthetic_documents(200, seed=0)
    return {
        kind: build_pretraining_data(tmp_path_factory.mktemp(kind), kind, documents)
        for kind in ("GPT2BPETokenizer", "BertWordPieceLowerCase")
    }


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
MODEL += ["--seq-length", "64", "--lr", "2e-3", "--log-interval", "1", "--train-iters", "6"]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "BertWordPieceLowerCase"])
def test_pretraining_keeps_its_loss_curve(
    kind: str, corpora: dict[str, PretrainingData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    module = gpt_module if kind == "GPT2BPETokenizer" else bert_module

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return fused_linear_cross_entropy(*args)

    monkeypatch.setattr(module, "fused_linear_cross_entropy", counted)
    curves = {}
    for fused in (False, True):
        save = tmp_path / ("fused" if fused else "plain")
        flags = [*corpora[kind].flags(), *MODEL, "--save", str(save)]
        trainer = Pretrainer(parse_args([*flags, *(["--fused-lm-loss"] if fused else [])]))
        trainer.fit()
        plan = [str(p) for p in trainer.engine.state.plan]  # type: ignore[union-attr]
        assert any(p.startswith("fused LM loss: torch, chunked") for p in plan) == fused, plan
        trainer.engine.close()
        curves[fused] = read_losses(save)
    assert len(calls) == 6  # the fused run's six training steps, one micro-batch each
    assert set(curves[True]) == set(range(1, 7))
    assert max(abs(curves[True][s] - curves[False][s]) for s in curves[False]) <= PARITY


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size"),
        ({"zero_backend": "deepspeed", "zero_2_memory_optimization": True}, "--fused-lm-loss"),
    ],
)
def test_layouts_it_cannot_serve_are_refused_before_anything_is_built(
    options: dict[str, Any], flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # checked before any process group exists
    config = RapidformerConfig.from_dict({"fused_lm_loss": True, **options})
    with pytest.raises(ConfigError, match=flag):
        RapidformerEngine(config, runs_loop=True)


def test_a_hand_written_loop_and_a_model_without_it_are_refused() -> None:
    config = RapidformerConfig.from_dict({"fused_lm_loss": True})
    with pytest.raises(ConfigError, match="hand-written loop"):
        RapidformerEngine(config)
    engine = RapidformerEngine(
        RapidformerConfig.from_dict({"fused_lm_loss": True, "train_iters": 1}), runs_loop=True
    )
    with pytest.raises(ConfigError, match="TinyTransformerLM does not compute its LM loss"):
        engine.compose(TinyTransformerLM(), optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_finetunes_on_the_same_loss_curve(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Finetuner's causal-LM task passes the labels; the patched forward runs the base
    model and the chunked loss (padding ignored, labels shifted) in training, and the model's
    own forward in evaluation."""
    from rapidformer import Finetuner
    from rapidformer.models import hf_fused_loss
    from rapidformer.testing.finetune import task_dataset, tiny_model

    calls = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return fused_linear_cross_entropy(*args)

    monkeypatch.setattr(hf_fused_loss, "fused_linear_cross_entropy", counted)
    model = tiny_model(kind, tmp_path / "model")
    data = task_dataset("causal_lm", tmp_path / "data", train=64, validation=16)
    curves = {}
    for fused in (False, True):
        save = tmp_path / ("fused" if fused else "plain")
        flags = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model)]
        flags += ["--data-dir", str(data), "--seq-length", "64", "--micro-batch-size", "8"]
        flags += ["--train-iters", "5", "--lr", "3e-3", "--log-interval", "1"]
        flags += ["--eval-interval", "5", "--save", str(save)]
        trainer = Finetuner(parse_args([*flags, *(["--fused-lm-loss"] if fused else [])]))
        metrics = trainer.fit()
        plan = [str(p) for p in trainer.engine.state.plan]  # type: ignore[union-attr]
        assert any(p.startswith("fused LM loss: torch, chunked") for p in plan) == fused, plan
        assert metrics["perplexity"] > 1  # evaluation ran the model's own forward
        trainer.engine.close()
        curves[fused] = read_losses(save)
    assert len(calls) == 5
    assert max(abs(curves[True][s] - curves[False][s]) for s in curves[False]) <= PARITY


def test_the_finetuner_refuses_other_tasks_and_families_before_anything_is_built(
    tmp_path: Path,
) -> None:
    import json

    from rapidformer import Finetuner

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    for task, path in (("masked_lm", "m"), ("causal_lm", str(tmp_path))):
        config = RapidformerConfig.from_dict(
            {"fused_lm_loss": True, "task": task, "pretrained_model_name_or_path": path}
        )
        violations = Finetuner.config_violations(config)
        assert any(v.flag == "--fused-lm-loss" for v in violations), (task, violations)


def _gpt_losses(out: str, fused: bool) -> None:
    """4 steps of a tiny built-in GPT on global batches of 8 (rank r takes its share), under
    ZeRO-3 (FSDP2) on two ranks; the global-batch losses to a file."""
    import json
    import os

    from rapidformer.models.gpt import GPTConfig, GPTModel
    from rapidformer.step_io import StepFunctions

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options = {"lr": 1e-3, "micro_batch_size": 8 // world, "global_batch_size": 8}
    options |= {"train_iters": 4, "seq_length": 32, "fused_lm_loss": fused}
    if world > 1:
        options["zero_3_memory_optimization"] = True
    engine = RapidformerEngine(
        RapidformerConfig.from_dict(options), builds_optimizer=True, runs_loop=True
    )
    shape = GPTConfig(
        vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
        max_position_embeddings=32, dropout=0.0,
    )  # fmt: skip
    model = GPTModel.build(shape, device="cpu", seed=0)
    state = engine.compose(model)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        if fused:  # the head and the loss inside the (sharded) model's forward
            return state.model(ids[:, :-1], None, ids[:, 1:])
        return F.cross_entropy(state.model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    functions = StepFunctions(train_step=loss, weight=lambda ids: ids[:, 1:].numel())
    data = torch.randint(0, 96, (4, 8, 33), generator=torch.Generator().manual_seed(1))
    rank, share = engine.env.rank, 8 // world
    losses = [
        engine.run_step([step[rank * share : (rank + 1) * share]], functions).loss for step in data
    ]
    plan = [str(p) for p in state.plan]
    name = f"{'fused' if fused else 'plain'}_{world}_{rank}.json"
    (Path(out) / name).write_text(json.dumps([losses, plan]))
    engine.close()


@pytest.mark.distributed
def test_under_fsdp2_on_two_ranks_it_keeps_the_one_process_losses(tmp_path: Path) -> None:
    import json

    from rapidformer.testing.launch import run_distributed

    _gpt_losses(str(tmp_path), fused=False)
    run_distributed(_gpt_losses, 2, str(tmp_path), True)
    plain, _ = json.loads((tmp_path / "plain_1_0.json").read_text())
    fused, plan = json.loads((tmp_path / "fused_2_0.json").read_text())
    assert any(p.startswith("fused LM loss") for p in plan)
    assert any("ZeRO-3" in p for p in plan), plan
    assert max(abs(a - b) for a, b in zip(plain, fused, strict=True)) <= PARITY, (plain, fused)


def test_a_training_forward_without_labels_fails_loudly() -> None:
    """Without the labels the switch could not take effect: the model says so."""
    from rapidformer.models.gpt import GPTConfig, GPTModel

    shape = GPTConfig(
        vocab_size=96, num_layers=1, hidden_size=32, num_attention_heads=4,
        max_position_embeddings=16,
    )  # fmt: skip
    model = GPTModel.build(shape, device="cpu", seed=0)
    model.fused_lm_loss = True  # what --fused-lm-loss sets
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"--fused-lm-loss: GPTModel\.forward ran in training"):
        model(ids)
    model.eval()
    assert model(ids).shape == (2, 16, 96)  # evaluation keeps the logits
