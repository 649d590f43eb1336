"""Hugging Face loading and saving for fine-tuning: a saved model loads with its exact
parameters, is written back from gathered weights (also from a model holding DTensors) and
reloads the same; bad directories give errors naming --pretrained-model-name-or-path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_module

from rapidformer.errors import ConfigError
from rapidformer.models.hf import (
    check_vocabulary,
    disable_generation_cache,
    generation_cache,
    load_model,
    load_tokenizer,
    save_model,
    tp_plan_of,
)
from rapidformer.testing.finetune import tiny_model

transformers = pytest.importorskip("transformers")

CAUSAL = "AutoModelForCausalLM"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model("gpt2", tmp_path_factory.mktemp("models") / "gpt2")


def _same_weights(one: torch.nn.Module, two: torch.nn.Module) -> None:
    first, second = one.state_dict(), two.state_dict()
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def test_a_saved_model_loads_with_its_parameters_and_tokenizer(gpt2: Path) -> None:
    model = load_model(str(gpt2), CAUSAL)
    _same_weights(model, transformers.GPT2LMHeadModel.from_pretrained(gpt2))
    tokenizer = load_tokenizer(str(gpt2))
    assert tokenizer.pad_token == tokenizer.eos_token  # GPT-2 has none: padding needs one
    assert len(tokenizer) == 300


def test_save_model_writes_the_given_weights_and_they_reload(gpt2: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model(str(gpt2), CAUSAL), load_tokenizer(str(gpt2))
    # The gathered state dict, not the module's own tensors, is what lands on disk.
    doubled = {name: value * 2 for name, value in model.state_dict().items()}
    save_model(model, tokenizer, tmp_path / "out", doubled)
    reloaded = load_model(str(tmp_path / "out"), CAUSAL)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, doubled[name]), name
    text = "the farmer sells the bread"
    assert load_tokenizer(str(tmp_path / "out"))(text) == tokenizer(text)


def test_a_model_holding_dtensors_is_saved_from_its_gathered_weights(
    gpt2: Path, tmp_path: Path
) -> None:
    # An earlier in-process test (DeepSpeed's) may have left its one-rank group: reuse it.
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reference = load_model(str(gpt2), CAUSAL)
        model = load_model(str(gpt2), CAUSAL)
        distribute_module(model, init_device_mesh("cpu", (1,)))  # every parameter a DTensor
        assert all(isinstance(p, DTensor) for p in model.parameters())
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        save_model(model, load_tokenizer(str(gpt2)), tmp_path / "out", full)
    finally:
        if owns_group:
            dist.destroy_process_group()
    reloaded = load_model(str(tmp_path / "out"), CAUSAL)
    _same_weights(reloaded, reference)  # tied embeddings included


def test_bad_directories_name_the_flag_and_what_is_wrong(gpt2: Path, tmp_path: Path) -> None:
    flag = "--pretrained-model-name-or-path"
    with pytest.raises(ConfigError, match=rf"{flag}='.*missing': no such model directory"):
        load_model(str(tmp_path / "missing"), CAUSAL)
    with pytest.raises(ConfigError, match=rf"{flag}=.*no such model directory"):
        load_tokenizer(str(tmp_path / "missing"))

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README").write_text("not a model")
    with pytest.raises(ConfigError, match=r"holds no model: no config.json there .found: README"):
        load_model(str(empty), CAUSAL)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(gpt2 / "config.json", no_weights)
    with pytest.raises(ConfigError, match=r"holds no loadable model weights"):
        load_model(str(no_weights), CAUSAL)
    with pytest.raises(ConfigError, match=r"cannot be loaded as AutoModelForSeq2SeqLM"):
        load_model(str(gpt2), "AutoModelForSeq2SeqLM")


def test_a_tokenizer_larger_than_the_embeddings_is_refused(gpt2: Path) -> None:
    model = load_model(str(gpt2), CAUSAL)
    check_vocabulary(model, 300, str(gpt2))  # the tokenizer it was saved with
    with pytest.raises(ConfigError, match=r"tokenizer has 301 entries but the model embeds only"):
        check_vocabulary(model, 301, str(gpt2))


def test_the_tensor_parallel_plan_is_read_from_config_json(gpt2: Path, tmp_path: Path) -> None:
    assert tp_plan_of(str(gpt2)) is None  # GPT-2 ships none
    assert tp_plan_of("some-org/some-model") is None  # a hub name is not fetched
    plan = tp_plan_of(str(tiny_model("llama", tmp_path / "llama")))
    assert plan and any("q_proj" in key for key in plan)


def test_training_runs_without_the_generation_cache_and_saving_keeps_the_models_own(
    gpt2: Path, tmp_path: Path
) -> None:
    model = load_model(str(gpt2), CAUSAL)
    assert model.config.use_cache is True  # GPT-2's own setting
    assert disable_generation_cache(model) and model.config.use_cache is False
    assert not disable_generation_cache(model)  # once only: the original stays recorded
    with generation_cache(model):
        assert model.config.use_cache is True
    assert model.config.use_cache is False
    save_model(model, load_tokenizer(str(gpt2)), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False  # still training


def test_a_mistyped_local_path_is_said_at_once_with_its_closest_sibling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``models/tiny-lama`` where ``models/`` exists is a path, not a hub name: refused at once
    (no hub call), naming the directory it likely meant."""
    from rapidformer.models import hf

    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf, "hub_unreachable", lambda: pytest.fail("the hub was asked"))
    with pytest.raises(
        ConfigError, match=r"no such model directory.*did you mean models/tiny-llama"
    ):
        hf.load_tokenizer("models/tiny-lama")
