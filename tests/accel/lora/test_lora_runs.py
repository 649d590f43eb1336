"""Fine-tuning with adapters, end to end on one process: the saved adapter is PEFT's (PEFT
loads it to the same logits, and an adapter PEFT saved trains on), checkpoints hold only what
trains and resume bit for bit, a resume onto another base is refused, and the merged export
computes what the adapted model does."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rapidformer import Finetuner, parse_args
from rapidformer.errors import CheckpointError, ConfigError
from rapidformer.export import main as export_main
from rapidformer.testing.finetune import task_dataset, tiny_model
from tests.helpers.trainers import read_losses

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "llama": tiny_model("llama", root / "llama"),
        "other_llama": tiny_model("llama", root / "other", seed=1),
        "bert": tiny_model("bert", root / "bert"),
        "clm": task_dataset("causal_lm", root / "clm", train=48, validation=8),
        "cls": task_dataset("sequence_classification", root / "cls", train=48, validation=8),
    }


def _finetuner(model: Path, data: Path, task: str, *flags: str) -> Finetuner:
    return Finetuner(
        parse_args(
            [
                *("--task", task, "--pretrained-model-name-or-path", str(model)),
                *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "4"),
                *("--lr", "1e-2", "--log-interval", "1", "--lora-rank", "4", *flags),
            ]
        )
    )


def _ids() -> torch.Tensor:
    return torch.randint(5, 250, (2, 20), generator=torch.Generator().manual_seed(0))


def test_the_saved_adapter_is_peft_s_and_the_merged_export_computes_the_same(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    save = tmp_path / "run"
    trainer = _finetuner(
        setup["llama"], setup["clm"], "causal_lm",
        "--lora-variant", "dora", "--train-iters", "3", "--save", str(save),
    )  # fmt: skip
    trainer.fit()
    assert trainer.model is not None
    ours = trainer.engine.state.unwrapped_model.eval()  # type: ignore[union-attr]
    with torch.no_grad():
        adapted = ours(input_ids=_ids()).logits

    # The checkpoint holds only what trains; the base is recorded by its fingerprint.
    checkpoint = torch.load(save / "iter_0000003" / "model.pt")
    assert checkpoint and all(".lora_" in name for name in checkpoint)
    record = json.loads((save / "iter_0000003" / "progress.json").read_text())["frozen_base"]
    assert record["source"] == str(setup["llama"]) and len(record["sha256"]) == 64

    auto = transformers.AutoModelForCausalLM
    loaded = peft.PeftModel.from_pretrained(auto.from_pretrained(setup["llama"]), save).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=_ids()).logits
        untrained = auto.from_pretrained(setup["llama"])(input_ids=_ids()).logits
    assert (theirs - adapted).abs().max().item() <= TOLERANCE
    assert (adapted - untrained).abs().max().item() > 1e-3  # it trained

    # The export of the checkpoint: PEFT's directory (the same tensors), or merged.
    assert export_main([str(save), str(tmp_path / "adapter")]) == 0
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    final = load_file(save / "adapter_model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert export_main([str(save), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        gap = (merged(input_ids=_ids()).logits - adapted).abs().max().item()
    assert gap <= TOLERANCE


def test_an_adapter_peft_saved_trains_on_with_its_classifier(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    auto = transformers.AutoModelForSequenceClassification
    base = auto.from_pretrained(setup["bert"], num_labels=4)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS",
        init_lora_weights=False, modules_to_save=["pooler"],  # new in this checkpoint: random
    )  # fmt: skip
    torch.manual_seed(3)
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path / "peft")
    before = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(k.endswith("classifier.weight") for k in before)

    save = tmp_path / "run"
    trainer = Finetuner(
        parse_args(
            [
                *("--task", "sequence_classification", "--lr", "1e-2", "--train-iters", "2"),
                *("--pretrained-model-name-or-path", str(setup["bert"])),
                *("--data-dir", str(setup["cls"]), "--seq-length", "32"),
                *("--lora-adapter", str(tmp_path / "peft"), "--save", str(save)),
            ]
        )
    )
    trainer.fit()
    after = load_file(save / "adapter_model.safetensors")
    assert after.keys() == before.keys()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert any("lora_B" in k for k in changed) and any("classifier" in k for k in changed)
    loaded = peft.PeftModel.from_pretrained(auto.from_pretrained(setup["bert"], num_labels=4), save)
    ours = trainer.engine.state.unwrapped_model.eval()  # type: ignore[union-attr]
    with torch.no_grad():
        adapted = ours(input_ids=_ids()).logits
        gap = (loaded.eval()(input_ids=_ids()).logits - adapted).abs().max()
    assert gap.item() <= TOLERANCE
    # Merged with the run's own config (4 labels, their names), the classifier and pooler in.
    assert export_main([str(save), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = auto.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.num_labels == 4 and merged.config.id2label == ours.config.id2label
    with torch.no_grad():
        assert (merged(input_ids=_ids()).logits - adapted).abs().max().item() <= TOLERANCE


def test_what_an_adapter_cannot_take_is_refused(setup: dict[str, Path], tmp_path: Path) -> None:
    auto = transformers.AutoModelForCausalLM
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, use_rslora=True)
    peft.get_peft_model(auto.from_pretrained(setup["llama"]), config).save_pretrained(
        tmp_path / "both"
    )
    with pytest.raises(ConfigError, match="DoRA with rsLoRA's scaling together"):
        _finetuner(setup["llama"], setup["clm"], "causal_lm", "--train-iters", "1",
                   "--lora-adapter", str(tmp_path / "both")).fit()  # fmt: skip
    plain = peft.LoraConfig(r=4, target_modules=["q_proj"])
    peft.get_peft_model(auto.from_pretrained(setup["llama"]), plain).save_pretrained(
        tmp_path / "plain"
    )
    with pytest.raises(ConfigError, match=r"--lora-target-modules=.v_proj.: cannot change"):
        _finetuner(setup["llama"], setup["clm"], "causal_lm", "--train-iters", "1",
                   "--lora-adapter", str(tmp_path / "plain"),
                   "--lora-target-modules", "v_proj").fit()  # fmt: skip
    with pytest.raises(ConfigError, match=r"output head .*lm_head.* --fused-lm-loss"):
        _finetuner(setup["llama"], setup["clm"], "causal_lm", "--train-iters", "1",
                   "--lora-target-modules", "q_proj,lm_head", "--fused-lm-loss").fit()  # fmt: skip


def test_a_resumed_adapter_run_repeats_the_uninterrupted_one_bitwise(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    flags = ("--train-iters", "6", "--save-interval", "3", "--lora-dropout", "0.1")
    full = tmp_path / "full"
    _finetuner(setup["llama"], setup["clm"], "causal_lm", *flags, "--save", str(full)).fit()
    again = tmp_path / "again"
    _finetuner(
        setup["llama"], setup["clm"], "causal_lm", *flags,
        "--save", str(again), "--load", str(full / "iter_0000003"),
    ).fit()  # fmt: skip
    first, second = read_losses(full), read_losses(again)
    assert sorted(second) == [4, 5, 6]
    assert all(second[step] == first[step] for step in (4, 5, 6)), (first, second)
    a = load_file(full / "adapter_model.safetensors")
    b = load_file(again / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(CheckpointError, match=r"other adapters .*lora_alpha 8.0 there, 4.0"):
        _finetuner(
            setup["llama"], setup["clm"], "causal_lm", *flags, "--lora-alpha", "4",
            "--save", str(tmp_path / "alpha"), "--load", str(full / "iter_0000003"),
        ).fit()  # fmt: skip
    with pytest.raises(CheckpointError, match="adapters trained on another base"):
        _finetuner(
            setup["other_llama"], setup["clm"], "causal_lm", *flags,
            "--save", str(tmp_path / "other"), "--load", str(full / "iter_0000003"),
        ).fit()  # fmt: skip
