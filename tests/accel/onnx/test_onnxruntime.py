"""--onnx-runtime-training: ONNX Runtime computes the loss and gradients, torch steps the
parameters. Loss curves match eager torch (tiny BERT through the Finetuner, the built-in GPT
through the Pretrainer), the trained weights evaluate the same in torch, and every combination
the feature does not support is refused before anything is built."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import Finetuner, RapidformerConfig, parse_args
from rapidformer.engine import validate
from rapidformer.errors import ConfigError
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.templates.trainer import Trainer
from tests.helpers.trainers import launched, read_losses

STEPS = 20
PARITY_RTOL = 1e-5
"""Relative train-loss tolerance over 20 steps; measured max relative difference 0.9-1.7e-7
(BERT, over several runs) and 1.8e-7 (GPT): ORT and torch sum in different orders."""
EVAL_ATOL = 1e-5
"""Eval-loss tolerance (evaluation runs in torch with the weights ORT's gradients trained);
measured difference 0 to 1.2e-7."""
ORT = ["--onnx-runtime-training"]


def _ort() -> None:
    pytest.importorskip(
        "onnxruntime.training",
        reason="needs onnxruntime-training (pip install 'rapidformer[onnx]', Python 3.10/3.11)",
        exc_type=ImportError,
    )


def _fit(trainer: Trainer) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    try:
        metrics = trainer.fit()
    finally:
        trainer.engine.close()
    state = trainer.engine.state
    assert state is not None
    weights = {k: v.detach().clone() for k, v in state.unwrapped_model.state_dict().items()}
    return metrics, weights


def _compare(eager: Path, ort: Path) -> tuple[float, float]:
    """Max relative train-loss difference and eval-loss difference of two runs."""
    a, b = read_losses(eager), read_losses(ort)
    assert a.keys() == b.keys() and len(a) == STEPS
    train = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
    ea, eb = read_losses(eager, "eval"), read_losses(ort, "eval")
    assert ea.keys() == eb.keys() and ea
    return train, max(abs(ea[k] - eb[k]) for k in ea)


def _plan(trainer: Trainer) -> list[str]:
    state = trainer.engine.state
    assert state is not None
    return [str(step) for step in state.plan]


def _ort_plan_step(trainer: Trainer) -> str:
    (step,) = [step for step in _plan(trainer) if step.startswith("ONNX Runtime training")]
    return step


def test_tiny_bert_sequence_classification_matches_eager(tmp_path: Path) -> None:
    _ort()
    from rapidformer.testing.finetune import task_dataset, tiny_model

    model = tiny_model("bert", tmp_path / "bert", max_positions=32)
    data = task_dataset("sequence_classification", tmp_path / "data", train=160, validation=32)
    flags = [
        *("--task", "sequence_classification", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "8"),
        *("--global-batch-size", "16", "--train-iters", str(STEPS), "--lr", "5e-3"),
        *("--hidden-dropout", "0", "--log-interval", "1", "--eval-interval", "10"),
    ]
    runs = {}
    for name, extra in (("eager", []), ("ort", ORT)):
        trainer = Finetuner(parse_args([*flags, "--save", str(tmp_path / name), *extra]))
        runs[name] = (*_fit(trainer), trainer)
    train, evaluation = _compare(tmp_path / "eager", tmp_path / "ort")
    assert train <= PARITY_RTOL, train
    assert evaluation <= EVAL_ATOL, evaluation
    (_, eager_weights, _), (_, ort_weights, ort) = runs["eager"], runs["ort"]
    assert max((eager_weights[k] - ort_weights[k]).abs().max().item() for k in eager_weights) < 1e-4
    last = _ort_plan_step(ort)
    assert last.startswith("ONNX Runtime training: onnxruntime-training 1.19")
    assert last.endswith(
        "training API (forward+backward), torch optimizer (CPU execution provider)"
    )
    # Two accumulated micro-batches of one shape per step: one graph exported.
    assert ort.engine.state is not None
    assert ort.engine.state.forward_backward.exports == 1  # type: ignore[attr-defined]
    _record("bert", train, evaluation)


def test_builtin_gpt_pretraining_matches_eager(tmp_path: Path) -> None:
    _ort()
    from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents

    data = build_pretraining_data(
        tmp_path / "corpus", "GPT2BPETokenizer", synthetic_documents(100, seed=0)
    )
    flags = [
        *data.flags(),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--micro-batch-size", "4", "--train-iters", str(STEPS)),
        *("--lr", "2e-3", "--hidden-dropout", "0", "--log-interval", "1"),
        *("--eval-interval", "10", "--eval-iters", "2"),
    ]
    trainers = {}
    for name, extra in (("eager", []), ("ort", ORT)):
        trainers[name] = Pretrainer(parse_args([*flags, "--save", str(tmp_path / name), *extra]))
        _fit(trainers[name])
    assert _ort_plan_step(trainers["ort"]).startswith("ONNX Runtime training: onnxruntime-training")
    assert not any("ONNX" in step for step in _plan(trainers["eager"]))
    train, evaluation = _compare(tmp_path / "eager", tmp_path / "ort")
    assert train <= PARITY_RTOL, train
    assert evaluation <= EVAL_ATOL, evaluation
    _record("gpt", train, evaluation)


def test_a_resumed_run_continues_the_same_losses(tmp_path: Path) -> None:
    """Checkpoints are torch's: a run stopped at step 10 and resumed (ORT copies the loaded
    weights in) gives the losses of an uninterrupted run, dropout included (ORT's masks are
    seeded from torch's RNG, which the checkpoint restores)."""
    _ort()
    from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents

    data = build_pretraining_data(
        tmp_path / "corpus", "GPT2BPETokenizer", synthetic_documents(100, seed=0)
    )
    flags = [
        *data.flags(),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--micro-batch-size", "4", "--lr", "2e-3"),
        *("--hidden-dropout", "0.1", "--log-interval", "1", *ORT),
    ]
    flags += ["--train-iters", "20"]
    _fit(Pretrainer(parse_args([*flags, "--save", str(tmp_path / "a"), "--save-interval", "10"])))
    load = str(tmp_path / "a" / "iter_0000010")
    _fit(Pretrainer(parse_args([*flags, "--load", load, "--save", str(tmp_path / "b")])))
    whole, resumed = read_losses(tmp_path / "a"), read_losses(tmp_path / "b")
    assert sorted(resumed) == list(range(11, 21))
    assert max(abs(whole[k] - resumed[k]) / whole[k] for k in resumed) <= PARITY_RTOL


@pytest.mark.distributed
def test_two_ranks_match_one_process_with_accumulation(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Data parallel: each rank runs ORT, the gradients are averaged over the ranks before the
    step (DDP's hooks stay idle). 2 ranks x micro-batch 4 must give the losses of one process
    accumulating 2 micro-batches of 4."""
    _ort()
    from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents

    data = build_pretraining_data(
        tmp_path / "corpus", "GPT2BPETokenizer", synthetic_documents(100, seed=0)
    )
    flags = [
        *data.flags(),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8"),
        *("--train-iters", "6", "--lr", "2e-3", "--hidden-dropout", "0", "--log-interval", "1"),
        *("--eval-iters", "2", *ORT),
    ]
    _fit(Pretrainer(parse_args([*flags, "--save", str(tmp_path / "single")])))
    said = launched(
        ["--nproc-per-node", "2", "--task", "pretraining", *flags, "--save", str(tmp_path / "ddp")],
        capfd,
    )
    single, ddp = read_losses(tmp_path / "single"), read_losses(tmp_path / "ddp")
    assert single.keys() == ddp.keys() == set(range(1, 7))
    assert max(abs(single[k] - ddp[k]) / single[k] for k in single) <= PARITY_RTOL, (single, ddp)
    assert "gradients averaged over 2 data-parallel ranks by rapidformer" in said
    assert "DistributedDataParallel" not in said  # no DDP around the exported module


def test_dropout_trains_like_eager_and_is_seeded(tmp_path: Path) -> None:
    """ORT draws its own dropout masks, so losses are not comparable step by step: the
    evaluations (in torch, without dropout) must agree to a few percent (measured 0.2%), and
    two ORT runs with the same seed give the same losses."""
    _ort()
    from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents

    data = build_pretraining_data(
        tmp_path / "corpus", "GPT2BPETokenizer", synthetic_documents(100, seed=0)
    )
    flags = [
        *data.flags(),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "60"),
        *("--lr", "2e-3", "--hidden-dropout", "0.1", "--log-interval", "1"),
        *("--eval-interval", "30", "--eval-iters", "4"),
    ]
    for name, extra in (("eager", []), ("ort", ORT), ("ort2", ORT)):
        _fit(Pretrainer(parse_args([*flags, "--save", str(tmp_path / name), *extra])))
    eager, ort = read_losses(tmp_path / "eager", "eval"), read_losses(tmp_path / "ort", "eval")
    assert all(abs(eager[k] - ort[k]) / eager[k] < 0.03 for k in eager), (eager, ort)
    losses = read_losses(tmp_path / "ort")
    assert losses != read_losses(tmp_path / "eager")  # the masks differ from torch's
    assert losses == read_losses(tmp_path / "ort2")
    assert ort[60] < 0.8 * losses[1]  # it learns
    print(json.dumps({"dropout_eval": {"eager": eager, "ort": ort}}))


def test_gradients_match_eager_for_each_batch_shape() -> None:
    """One graph per input shape; padding rows of embeddings get no gradient, as in torch."""
    _ort()
    from rapidformer.accel.onnx.training import OrtTrainStep
    from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate

    torch.manual_seed(0)
    model = TinyTransformerLM(64, 32, 2, 4, 32)
    model.embed.padding_idx = 0
    data = MarkovLMDataset(16, 64, 6, 24, seed=1)
    step = OrtTrainStep(lambda batch: lm_loss(model, batch)["loss"], model)
    for rows, pad_to in ((8, 24), (5, 28), (8, 24)):
        batch = pad_collate([data[i] for i in range(rows)], pad_to=pad_to)
        batch["input_ids"][:, -2:] = 0  # padding tokens the loss sees through attention
        model.zero_grad()
        loss = step(batch)
        loss.backward()
        ort = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        eager = lm_loss(model, batch)
        eager["loss"].backward()
        assert torch.allclose(loss, eager["loss"], rtol=1e-6)
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(ort[name], p.grad, rtol=1e-4, atol=1e-7)
    assert step.exports == 2
    step.close()


def _assert_ort_gradients_match_eager(
    model: torch.nn.Module, train_step: Any, batch: dict[str, torch.Tensor], every: bool = True
) -> dict[str, torch.Tensor]:
    """One backward through ORT and one in torch: the parameters' gradients agree (``every``:
    each parameter has one). Returns ORT's gradients."""
    from rapidformer.accel.onnx.training import OrtTrainStep

    step = OrtTrainStep(train_step, model)
    step(batch).backward()
    ort = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    train_step(batch).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None or not every, name
        if p.grad is not None:
            torch.testing.assert_close(ort[name], p.grad, rtol=1e-4, atol=1e-6)
    step.close()
    return ort


def test_tied_weights_get_the_gradient_of_both_uses(tmp_path: Path) -> None:
    """BERT's MLM decoder shares the word embeddings (and their padding row)."""
    _ort()
    import transformers

    from rapidformer.testing.finetune import tiny_model

    model = transformers.BertForMaskedLM.from_pretrained(tiny_model("bert", tmp_path / "m"))
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, ::2] = -100
    batch = {"input_ids": ids, "labels": labels}
    _assert_ort_gradients_match_eager(model, lambda b: model(**b).loss, batch)


def test_gpt2_classifier_and_a_batch_tensor_the_step_does_not_read(tmp_path: Path) -> None:
    """GPT-2's classifier picks the last real token with an int64 ArgMax, which ORT's CPU
    kernels lack (rapidformer casts its input to double); a batch tensor train_step ignores is
    no graph input."""
    _ort()
    import transformers

    from rapidformer.testing.finetune import tiny_model

    path = tiny_model("gpt2", tmp_path / "m")
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification.from_pretrained(path, num_labels=3)
    model.config.pad_token_id = 0
    ids = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[:2, 8:] = 0
    batch = {"input_ids": ids, "labels": torch.tensor([0, 1, 2, 1]), "ids": torch.arange(4)}

    def train_step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=b["input_ids"], labels=b["labels"]).loss

    _assert_ort_gradients_match_eager(model, train_step, batch)


def test_t5_position_bias_gradient_through_a_broadcasting_where(tmp_path: Path) -> None:
    """T5 adds a position bias shaped for one sample to every sample's scores inside a masking
    Where, whose ORT gradient does not sum over the broadcast batch (rapidformer expands the
    input first)."""
    _ort()
    import transformers

    from rapidformer.testing.finetune import tiny_model

    model = transformers.T5ForConditionalGeneration.from_pretrained(tiny_model("t5", tmp_path))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[:2, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    batch["labels"] = torch.randint(5, 100, (4, 5), generator=generator)
    ort = _assert_ort_gradients_match_eager(model, lambda b: model(**b).loss, batch, every=False)
    assert any("relative_attention_bias" in name for name in ort)


def _record(name: str, train: float, evaluation: float) -> None:
    print(json.dumps({"model": name, "max_rel_train_loss_diff": train, "eval_diff": evaluation}))


# ---- refused combinations (no onnxruntime needed) -----------------------------------------
VALID = {"train_iters": 10, "lr": 1e-3, "onnx_runtime_training": True}


def _violations(world_size: int = 1, **flat: object) -> list[str]:
    config = RapidformerConfig.from_dict({**VALID, **flat})
    try:
        validate(config, world_size)
    except ConfigError as exc:
        return [str(v) for v in exc.violations if "cannot be imported" not in str(v)]
    return []


OWN = "--onnx-runtime-training=True: cannot run with "
REFUSED = {
    # Every refusal names ORT's own flag (its rules live in its module) and the other switch.
    "zero_2_memory_optimization": ("--sharding zero2 (--oss-sdp-memory-optimization",),
    "oss_memory_optimization": ("--sharding zero1 (--oss-memory-optimization",),
    "fsdp_memory_optimization": ("--sharding zero3 (--fsdp-memory-optimization",),
    "checkpoint_activations": ("--recompute-granularity full (--checkpoint-activations): ORT",),
    "torch_compile": ("--torch-compile: the forward and backward already run",),
    "num_experts": ("--num-experts 4: expert routing",),
    "precision": ("--precision bf16: ORT trains in fp32",),
    "mixed_precision": ("--precision fp16 (--mixed-precision): ORT trains in fp32",),
}
VALUES: dict[str, object] = {"num_experts": 4, "precision": "bf16"}


@pytest.mark.parametrize("field", list(REFUSED))
def test_unsupported_combinations_are_refused(field: str) -> None:
    found = _violations(**{field: VALUES.get(field, True)})
    (expected,) = REFUSED[field]
    assert any(v.startswith(OWN + expected) and "Fix: " in v for v in found), found


def test_cpu_offload_tensor_and_pipeline_parallel_are_refused() -> None:
    found = _violations(cpu_offload=True, zero_3_memory_optimization=True)
    assert any(v.startswith(OWN + "--cpu-offload") for v in found), found
    found = _violations(4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert any(v.startswith(OWN + "--tensor-model-parallel-size 2") for v in found), found
    assert any(v.startswith(OWN + "--pipeline-model-parallel-size 2") for v in found), found
    assert _violations(2) == []  # data parallelism is supported


def test_a_supported_config_passes_and_a_missing_runtime_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _violations() == []
    module = importlib.import_module("rapidformer.accel.onnx.training")
    monkeypatch.setattr(module, "_ort_importable", lambda: False)
    with pytest.raises(ConfigError) as error:
        validate(RapidformerConfig.from_dict(VALID), 1)
    message = str(error.value)
    assert "cannot be imported" in message and "rapidformer[onnx]" in message
    assert "Python 3.10 and 3.11 only" in message and "plain onnxruntime" in message


def test_a_hand_written_loop_cannot_ask_for_it() -> None:
    with pytest.raises(ConfigError, match="only the Trainer templates"):
        validate(RapidformerConfig.from_dict(VALID), 1, runs_loop=False)
