"""--liger-kernel: refused before anything is built without Liger or CUDA, or for a family Liger
does not patch; on a supported Hugging Face model, Liger's family patch runs on the instance
with RMSNorm, RoPE and SwiGLU on and its losses off, and the plan names it. The patching is
checked here against a stand-in for liger_kernel.transformers (no CUDA, no Liger here)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import Finetuner, RapidformerConfig, RapidformerEngine
from rapidformer.accel.liger import apply_liger_kernel
from rapidformer.errors import ConfigError
from rapidformer.testing import TinyTransformerLM

transformers = pytest.importorskip("transformers")


def test_refused_without_liger_or_cuda() -> None:
    config = RapidformerConfig.from_dict({"liger_kernel": True})
    with pytest.raises(ConfigError) as error:
        RapidformerEngine(config)
    text = str(error.value)
    if not torch.cuda.is_available():
        assert "no CUDA device" in text
    if "liger_kernel" not in sys.modules:
        assert "Liger-Kernel is not installed" in text and "rapidformer[gpu]" in text


def _composed(model: torch.nn.Module) -> tuple[Any, RapidformerConfig, Any]:
    engine = RapidformerEngine(RapidformerConfig.from_dict({}))
    state = engine.compose(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    return state, RapidformerConfig.from_dict({"liger_kernel": True}), engine


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    fake = types.ModuleType("liger_kernel.transformers")

    def patch(name: str) -> Any:
        return lambda **kwargs: calls.append((name, kwargs))

    for name in ("apply_liger_kernel_to_llama", "apply_liger_kernel_to_qwen2"):
        setattr(fake, name, patch(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    return calls


def test_a_llama_gets_its_family_patch(stand_in: list[tuple[str, dict[str, Any]]]) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config)
    state, liger_config, engine = _composed(model)
    apply_liger_kernel(state, liger_config, engine.mesh)
    ((name, kwargs),) = stand_in
    assert name == "apply_liger_kernel_to_llama" and kwargs["model"] is model
    assert kwargs["rope"] and kwargs["rms_norm"] and kwargs["swiglu"]
    assert not kwargs["cross_entropy"] and not kwargs["fused_linear_cross_entropy"]
    assert any(
        str(p).startswith("Liger-Kernel: liger_kernel.transformers.apply_liger_kernel_to_llama")
        for p in state.plan
    )
    engine.close()


def test_unsupported_families_and_non_hugging_face_models_are_refused(
    stand_in: list[tuple[str, dict[str, Any]]],
) -> None:
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64,
        )
    )  # fmt: skip
    for model, message in ((bert, "no patch for bert"), (TinyTransformerLM(), "not a Hugging")):
        state, liger_config, engine = _composed(model)
        with pytest.raises(ConfigError, match=message):
            apply_liger_kernel(state, liger_config, engine.mesh)
        engine.close()
    assert stand_in == []


def test_the_finetuner_refuses_an_unsupported_family_from_its_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    config = RapidformerConfig.from_dict(
        {"liger_kernel": True, "task": "masked_lm", "pretrained_model_name_or_path": str(tmp_path)}
    )
    flags = [v.flag for v in Finetuner.config_violations(config)]
    assert "--liger-kernel" in flags
