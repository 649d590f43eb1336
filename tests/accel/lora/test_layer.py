"""The adapter layer against PEFT's: the same targets for all-linear, the same outputs and
gradients for LoRA, DoRA and rsLoRA on the same initialisation (within 1e-5, fp32), a merged
weight that computes what the adapted layer does, and a first loss that is the base's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from rapidformer.accel.lora.layer import AdapterShape, attach, init_adapter, merged_weight
from rapidformer.accel.lora.peft_format import read_settings, read_tensors
from rapidformer.accel.lora.start import load_adapter_tensors
from rapidformer.accel.lora.targets import modules_to_save, target_paths

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _bert_classifier() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).eval()


def _peft_adapter(model: nn.Module, out: Path, **options: object) -> nn.Module:
    """PEFT's model with random (non-zero) adapters, saved to ``out``."""
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **options
    )
    wrapped = peft.get_peft_model(copy.deepcopy(model), config).eval()
    if config.use_dora:  # PEFT sets the magnitude to the norms; move it off them
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_magnitude_vector" in name:
                    param.mul_(1.0 + 0.1 * torch.rand_like(param))
    wrapped.save_pretrained(out)
    return wrapped


def _ours_from(model: nn.Module, adapter: Path) -> nn.Module:
    ours = copy.deepcopy(model)
    settings = read_settings(adapter)
    saved = list(settings.modules_to_save)
    targets = target_paths(ours, ",".join(settings.targets), saved)
    modules = dict(ours.named_modules())
    for parameter in ours.parameters():
        parameter.requires_grad_(False)
    for path in targets:
        attach(modules[path], settings.shape)
    for path in saved:
        modules[path].requires_grad_(True)
    load_adapter_tensors(ours, read_tensors(adapter), str(adapter))
    return ours.eval()


def _trainable_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    grads = {
        name.replace("base_model.model.", "").replace(".default", "")
        .replace("lora_magnitude_vector.weight", "lora_magnitude_vector"): p.grad.clone()
        for name, p in model.named_parameters() if p.requires_grad
    }  # fmt: skip
    return logits.detach(), grads


@pytest.mark.parametrize(
    "options", [{}, {"use_dora": True}, {"use_rslora": True}], ids=["lora", "dora", "rslora"]
)
def test_outputs_and_gradients_match_peft_on_the_same_initialisation(
    options: dict[str, bool], tmp_path: Path
) -> None:
    base = _llama()
    theirs = _peft_adapter(base, tmp_path, **options)
    ours = _ours_from(base, tmp_path)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    their_logits, their_grads = _trainable_grads(theirs, ids)
    our_logits, our_grads = _trainable_grads(ours, ids)
    assert torch.isfinite(their_logits).all() and their_logits.abs().max() > 0
    assert (our_logits - their_logits).abs().max().item() <= TOLERANCE
    assert our_grads.keys() == their_grads.keys()
    assert len(our_grads) == 14 * (3 if options.get("use_dora") else 2)
    for name, grad in our_grads.items():
        scale = max(1.0, their_grads[name].abs().max().item())
        assert (grad - their_grads[name]).abs().max().item() <= TOLERANCE * scale, name


def test_all_linear_and_the_classifier_head_are_peft_s(tmp_path: Path) -> None:
    """all-linear picks what PEFT's all-linear picks; a classifier is trained in full."""
    for model, task, peft_task in (
        (_llama(), "causal_lm", "CAUSAL_LM"),
        (_bert_classifier(), "sequence_classification", "SEQ_CLS"),
    ):
        config = peft.LoraConfig(r=4, target_modules="all-linear", task_type=peft_task)
        wrapped = peft.get_peft_model(copy.deepcopy(model), config)
        theirs = sorted(wrapped.peft_config["default"].target_modules)
        saved = modules_to_save(model, None, task)
        assert sorted(target_paths(model, "all-linear", saved)) == theirs
        assert saved == (["classifier"] if task == "sequence_classification" else [])


def test_names_and_a_regular_expression_select_layers() -> None:
    model = _llama()
    by_name = target_paths(model, "q_proj,v_proj", [])
    assert by_name == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
    ]
    by_regex = target_paths(model, r".*\.1\.mlp\.(up|down)_proj", [])
    assert by_regex == ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize("variant", ["lora", "dora", "rslora"])
def test_the_merged_weight_computes_what_the_adapted_layer_does(variant: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    plain = copy.deepcopy(layer)
    attach(layer, AdapterShape(4, 6.0, variant))
    init_adapter(layer, torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.lora_B.weight.normal_()  # B starts at zero: make the adapter do something
        if variant == "dora":
            layer.lora_magnitude_vector.mul_(1.5)
    x = torch.randn(5, 24)
    with torch.no_grad():
        plain.weight.copy_(merged_weight(layer))
        assert (layer(x) - plain(x)).abs().max().item() <= TOLERANCE
        assert (layer(x) - nn.functional.linear(x, layer.weight, layer.bias)).abs().max() > 0.1


@pytest.mark.parametrize("variant", ["lora", "dora", "rslora"])
def test_fresh_adapters_leave_the_base_output_exactly(variant: str) -> None:
    """B starts at zero (DoRA's magnitude at the base's norms): the adapted model's first
    loss is the base model's, bit for bit for LoRA."""
    base = _llama()
    adapted = copy.deepcopy(base)
    modules = dict(adapted.named_modules())
    for path in target_paths(adapted, "all-linear", []):
        attach(modules[path], AdapterShape(4, 8.0, variant))
        init_adapter(modules[path], torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (adapted(input_ids=ids).logits - base(input_ids=ids).logits).abs().max().item()
    assert gap == 0.0 if variant != "dora" else gap <= TOLERANCE
