"""A closed engine's model is freed when its last reference goes, not at the next run of
Python's cycle collector.

The switches that wrap a module's forward on the instance (autocast, each recompute mode, the
fused LM loss on a Hugging Face model) once tied the module to itself: after ``close()`` every
parameter stayed allocated until a collection, on a GPU while the next model was built. Each
test counts, with the collector off, the parameters still alive after the last reference went:
before the fix 32-36 of 36 here, now none.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import StepFunctions

SHAPE = GPTConfig(
    vocab_size=128, num_layers=4, hidden_size=32, num_attention_heads=4,
    max_position_embeddings=16, dropout=0.0,
)  # fmt: skip
SWITCHES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "full recompute": {"recompute_granularity": "full"},
    "selective recompute, bf16": {"recompute_granularity": "selective", "precision": "bf16"},
    "block recompute": {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2,
    },
    "uniform chunks of 2": {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2,
    },
}  # fmt: skip


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _train_and_close(options: dict[str, Any]) -> tuple[list[weakref.ref[Any]], float]:
    """One step of a tiny GPT with these switches, then close; weak references to every
    parameter, and the loss (the switches ran)."""
    config = RapidformerConfig.from_dict(
        {"lr": 1e-3, "seq_length": 16, "micro_batch_size": 2, "log_interval": 10**9, **options}
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    state = engine.compose(GPTModel.build(SHAPE, "meta"))
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = state.model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    result = engine.run_step([ids], StepFunctions(train_step=loss, weight=lambda b: b.shape[0]))
    references = [weakref.ref(p) for p in state.model.parameters()]
    engine.close()
    return references, float(result.loss)


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_the_model_is_freed_without_the_cycle_collector(
    switches: str, no_cycle_collector: None
) -> None:
    references, loss = _train_and_close(SWITCHES[switches])
    assert 4.0 < loss < 6.0  # a step ran: ln(128) = 4.85 at the start
    alive = sum(reference() is not None for reference in references)
    assert (alive, len(references)) == (0, len(references))


def test_a_wrapped_forward_keeps_its_signature_and_its_module_working() -> None:
    """Callers read parameter names from ``inspect.signature(model.forward)``; the wrapped
    forward still gives the model's own, and still computes what the model computes."""
    from rapidformer.models.forward_wrap import current_forward

    model = GPTModel.build(SHAPE, "cpu", seed=0)
    before = inspect.signature(model.forward)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(ids)
    forward = current_forward(model)
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs) * 2.0
    assert inspect.signature(forward) == before
    torch.testing.assert_close(model(ids), expected * 2.0, rtol=0, atol=0)
    reference = weakref.ref(model)
    del model
    assert reference() is None  # freed by reference counting alone (the collector is on here)
    with pytest.raises(ReferenceError, match="GPTModel"):
        forward(ids)


def test_a_hugging_face_model_with_the_fused_loss_is_freed(no_cycle_collector: None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidformer.models.hf_fused_loss import patch_forward

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    before = inspect.signature(model.forward)
    patch_forward(model)
    assert inspect.signature(model.forward) == before
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    fused = model(input_ids=ids, labels=ids).loss
    model.eval()  # the model's own forward, which gives logits (the labels are not passed)
    logits = model(input_ids=ids, labels=ids).logits
    plain = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    references = [weakref.ref(p) for p in model.parameters()]
    del model, fused, plain, logits
    assert sum(reference() is not None for reference in references) == 0


def _freed_after_del(trainer: Any) -> tuple[int, int]:
    """Fit, close, drop the template: how many of its model's parameters are still alive."""
    trainer.fit()
    references = [weakref.ref(p) for p in trainer.engine.state.model.parameters()]
    trainer.engine.close()
    template = weakref.ref(trainer)
    del trainer
    assert template() is None
    return sum(reference() is not None for reference in references), len(references)


def test_del_trainer_frees_its_model(no_cycle_collector: None) -> None:
    """A template used to hold its engine, whose state held the template's bound
    ``build_optimizer`` (and a Pretrainer its own bound ``compute_loss``): `del trainer` freed
    nothing until a collection (29 of 29 and 36 of 36 parameters alive)."""
    from tests.helpers.trainers import tiny_trainer

    flags = ("--train-iters", "2", "--micro-batch-size", "8", "--precision", "bf16")
    alive, total = _freed_after_del(tiny_trainer(*flags, "--checkpoint-activations"))
    assert (alive, total) == (0, total)


def test_del_pretrainer_frees_its_model(tmp_path: Path, no_cycle_collector: None) -> None:
    from rapidformer import parse_args
    from rapidformer.templates.pretrainer import Pretrainer
    from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents

    data = build_pretraining_data(tmp_path, "GPT2BPETokenizer", synthetic_documents(200))
    flags = [*data.flags(), "--num-layers", "2", "--hidden-size", "64"]
    flags += ["--num-attention-heads", "4", "--seq-length", "64", "--lr", "2e-3"]
    flags += ["--train-iters", "2", "--micro-batch-size", "2", "--eval-iters", "1"]
    flags += ["--fused-lm-loss", "--recompute-granularity", "selective", "--precision", "bf16"]
    alive, total = _freed_after_del(Pretrainer(parse_args(flags)))
    assert (alive, total) == (0, total)
