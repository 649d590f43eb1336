"""FLOPs per token against hand counts, and MFU / TFLOP/s in every log line (console,
metrics.jsonl, TensorBoard), the peak table and the precision hints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from rapidformer.flops import flop_shape, flops_per_token, linear_weights
from rapidformer.hardware import gpu_peak, precision_support
from rapidformer.models.gpt import GPTConfig, GPTModel
from tests.helpers.trainers import tiny_trainer

L, H, V, S = 2, 32, 100, 16  # the built-in GPT below: layers, hidden, vocabulary, sequence


def test_built_in_gpt_matches_a_hand_count() -> None:
    config = GPTConfig(
        vocab_size=V, num_layers=L, hidden_size=H, num_attention_heads=4, max_position_embeddings=S
    )
    # Per layer: q, k, v and the output projection (4 h^2), the FFN h -> 4h -> h (8 h^2);
    # then the (tied) LM head V x h. Attention: 12 x layers x sequence x h.
    weights = L * (4 * H * H + 8 * H * H) + V * H
    assert weights == 27_776
    shape = flop_shape(config)
    assert shape is not None and shape.matrix_weights() == weights
    counted = flops_per_token(shape, S)
    assert counted.model == 6 * weights + 12 * L * S * H == 178_944
    # Checkpointing recomputes the blocks' forward: 2 x block weights + 4 s h per layer.
    again = flops_per_token(shape, S, recompute=True).hardware - counted.model
    assert again == 2 * L * 12 * H * H + 4 * S * H * L
    # The same weights are what the built model multiplies by (its nn.Linear layers).
    assert linear_weights(GPTModel(config)) == weights


def _llama(**extra: object) -> object:
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    if extra:
        return transformers.MixtralConfig(**fields, **extra)
    return transformers.LlamaConfig(**fields)


def test_hugging_face_llama_and_mixtral_match_hand_counts() -> None:
    # Llama, head_dim 16: q and o 64 x 64, k and v 64 x (2 heads x 16), SwiGLU 3 x 64 x 176.
    attention = 2 * 64 * 64 + 2 * 64 * 32
    per_layer = attention + 3 * 64 * 176
    weights = 2 * per_layer + 300 * 64
    config = _llama()
    shape = flop_shape(config)
    assert shape is not None and shape.matrix_weights() == weights == 111_360
    assert flops_per_token(shape, 32).model == 6 * weights + 12 * 2 * 32 * 64
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(config)
    assert linear_weights(model) == weights
    # Mixtral, 4 experts, top-2: the router (64 x 4) and two of the four experts per token.
    moe = _llama(num_local_experts=4, num_experts_per_tok=2)
    shape = flop_shape(moe)
    assert shape is not None
    assert shape.matrix_weights() == 2 * (attention + 64 * 4 + 2 * 3 * 64 * 176) + 300 * 64


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_mfu_and_tflops_are_in_every_log_line_and_tensorboard(tmp_path: Path) -> None:
    save = tmp_path / "run"
    flags = ["--train-iters", "6", "--log-interval", "3", "--save", str(save)]
    caught = _Messages()
    logger = logging.getLogger("rapidformer")
    level = logger.level
    logger.addHandler(caught)
    logger.setLevel(logging.INFO)
    try:
        tiny_trainer(*flags, "--peak-tflops", "0.5", "--checkpoint-activations").fit()
    finally:
        logger.removeHandler(caught)
        logger.setLevel(level)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6]
    lines = [m for m in caught.messages if m.startswith("train step")]
    assert len(lines) == 2 and all("| tflops " in m and "| mfu " in m for m in lines)
    plan = next(m for m in caught.messages if m.startswith("hardware:"))
    per_token = float(plan.split("model FLOPs per token ")[1].split(",")[0])
    for record in train:
        # One process: achieved TFLOP/s = tokens/s x model FLOPs per token; MFU against 0.5.
        assert record["tflops"] == pytest.approx(record["tokens_per_s"] * per_token / 1e12, 1e-2)
        assert record["mfu"] == pytest.approx(record["tflops"] / 0.5, rel=1e-9)
        assert record["hardware_tflops"] > record["tflops"]  # the recomputed forward
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/mfu")] == pytest.approx(
        [r["mfu"] for r in train], rel=1e-6
    )


def test_peak_table_and_precision_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_peak("NVIDIA H200", "bf16") == 989
    assert gpu_peak("NVIDIA H100 PCIe", "fp16") == 756
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert gpu_peak("Some Future GPU", "bf16") is None
    cpu = torch.device("cpu")
    monkeypatch.setattr("rapidformer.hardware.cpu_features", lambda: ["avx2"])
    text, hint = precision_support(cpu, "bf16")
    assert "avx2" in text and hint is not None and "slower than fp32" in hint
    assert precision_support(cpu, "fp32")[1] is None
    monkeypatch.setattr(
        "rapidformer.hardware.cpu_features", lambda: ["avx2", "avx512f", "avx512_bf16"]
    )
    assert precision_support(cpu, "bf16")[1] is None
    hint = str(precision_support(cpu, "fp16")[1])
    assert "fp16 has no fast matrix path" in hint and "bf16 is faster" in hint, hint
    # avx512_fp16 alone measured 0.85-0.90x of fp32 (benchmarks/precision.py): still a hint;
    # AMX-FP16 is the fast path.
    monkeypatch.setattr("rapidformer.hardware.cpu_features", lambda: ["avx512_fp16", "amx_bf16"])
    assert "avx512_fp16 but no AMX-FP16" in str(precision_support(cpu, "fp16")[1])
    monkeypatch.setattr("rapidformer.hardware.cpu_features", lambda: ["avx512_fp16", "amx_fp16"])
    assert precision_support(cpu, "fp16")[1] is None


def test_a_cpu_without_units_for_the_precision_takes_the_fp32_units_as_its_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 probe on a CPU without bf16 units came out below what a bf16 run reaches (MFU
    1.026): the fp32 units' probe bounds it, labelled; with units, the precision's own."""
    from rapidformer.hardware import device_peak

    rates = {"fp32": 0.03, "bf16": 0.0005}
    monkeypatch.setattr("rapidformer.hardware.probe_cpu_tflops", lambda p: rates[p])
    monkeypatch.setattr("rapidformer.hardware.cpu_features", lambda: ["avx2"])
    cpu = torch.device("cpu")
    peak = device_peak(cpu, "bf16", None)
    assert peak.tflops == 0.03 and "fp32 1024^2 matmul probe" in peak.source, peak
    assert "bf16 has no matrix units here" in peak.source
    monkeypatch.setattr("rapidformer.hardware.cpu_features", lambda: ["avx512_bf16"])
    rates["bf16"] = 0.06
    assert device_peak(cpu, "bf16", None).tflops == 0.06
    assert device_peak(cpu, "bf16", 2.0).tflops == 2.0  # --peak-tflops wins
