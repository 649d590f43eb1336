"""Adapters on the Pretrainer's built-in GPT (continued pretraining): the base comes from
``--pretrained-checkpoint`` (a finished run's checkpoint), the adapters' checkpoints are checked
against it, they merge into a Hugging Face export, and their runs on the built-in
tensor-parallel plan (dp2 x tp2, resuming 2-rank ZeRO-3) compute what one process does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from rapidformer import parse_args
from rapidformer.checkpoint import consolidated_model_state, find_checkpoint
from rapidformer.dryrun.command import run_dry_run
from rapidformer.errors import CheckpointError, ConfigError
from rapidformer.export import export_checkpoint
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents
from tests.helpers.trainers import launched, read_losses

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--hidden-dropout", "0", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--eval-interval", "1000", "--log-interval", "1",
    "--clip-grad", "0.5", "--lr-decay-style", "constant",
]  # fmt: skip
ADAPTERS = ["--lora-rank", "4", "--lr", "1e-2"]
TOLERANCE = 1e-5
"""fp32 loss curves of one layout against another (different reduction orders)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[PretrainingData, Path]:
    """The corpus, and a 4-step pretraining run's checkpoint: the base to adapt."""
    root = tmp_path_factory.mktemp("continued")
    data = build_pretraining_data(root / "gpt", "GPT2BPETokenizer", synthetic_documents(200, 1))
    _run(data, root / "base", "--lr", "2e-3", "--train-iters", "4")
    return data, root / "base"


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        (("--lora-variant", "dora"), "DoRA's weight norms are not computed over tensor-parallel"),
        (("--sequence-parallel",), "a row-parallel layer gives a shard of the sequence"),
        (("--lora-target-modules", "lm_head"), "lm_head is sharded neither column- nor row-"),
    ],
)
def test_the_built_in_tensor_parallel_plan_refuses_what_adapters_cannot_follow(
    base: tuple[PretrainingData, Path], extra: tuple[str, ...], refusal: str
) -> None:
    """Checked while the dry run composes each rank (the same step a run takes)."""
    data, base_dir = base
    flags = ["--task", "pretraining", *data.flags(), *FLAGS, *ADAPTERS,
             "--pretrained-checkpoint", str(base_dir), "--train-iters", "1",
             "--tensor-model-parallel-size", "2", "--dry-run", "--dry-run-world-size", "2",
             *extra]  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        run_dry_run(parse_args(flags))
    plain = run_dry_run(parse_args(flags[: -len(extra)]))  # LoRA itself follows the plan
    assert plain.plan[0].startswith("adapters: lora") and "tensor parallel" in plain.plan[1]
    # Each rank holds half of one factor per layer: less than the 9,216 trained values.
    assert plain.ranks[0].state.gradients < 9_216 * 4


def _run(data: PretrainingData, save: Path, *extra: str) -> Pretrainer:
    trainer = Pretrainer(parse_args([*data.flags(), *FLAGS, "--save", str(save), *extra]))
    try:
        trainer.fit()
    finally:
        trainer.engine.close()
    return trainer


def test_adapters_start_from_the_pretrained_checkpoint_and_export_merged(
    base: tuple[PretrainingData, Path], tmp_path: Path
) -> None:
    data, base_dir = base
    start = ["--pretrained-checkpoint", str(base_dir), "--train-iters", "3"]
    full = _run(data, tmp_path / "full", *start, "--lr", "1e-2")
    lora = _run(data, tmp_path / "lora", *start, *ADAPTERS)
    dora = _run(data, tmp_path / "dora", *start, *ADAPTERS, "--lora-variant", "dora")
    # B = 0 (and DoRA's magnitude = the base's norms): the first loss is the base model's.
    first = {name: read_losses(tmp_path / name)[1] for name in ("full", "lora", "dora")}
    assert first["lora"] == first["full"] == first["dora"]
    assert read_losses(tmp_path / "lora")[3] != first["lora"]  # and the adapters learn
    # The frozen weights are the checkpoint's, unchanged by three steps.
    saved = consolidated_model_state(find_checkpoint(base_dir))  # type: ignore[arg-type]
    model = lora.engine.state.unwrapped_model  # type: ignore[union-attr]
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(torch.equal(p, saved[n]) for n, p in frozen.items())
    assert full.engine.state is not None
    # Adapter checkpoints hold only the adapters, and refuse another base.
    record = json.loads((tmp_path / "lora" / "iter_0000003" / "progress.json").read_text())
    assert record["frozen_base"]["source"] == str(base_dir)
    other = tmp_path / "base2"
    _run(data, other, "--lr", "2e-3", "--train-iters", "2", "--seed", "7")
    with pytest.raises(CheckpointError, match="trained on another base"):
        _run(data, tmp_path / "lora", "--pretrained-checkpoint", str(other), "--train-iters", "4",
             *ADAPTERS)  # fmt: skip
    # A checkpoint of another shape is refused, named (here: a layer this model lacks).
    with pytest.raises(CheckpointError, match=r"blocks\.1\..* which this model lacks"):
        _run(data, tmp_path / "narrow", "--pretrained-checkpoint", str(base_dir),
             "--train-iters", "1", "--num-layers", "1", "--lr", "1e-3")  # fmt: skip
    # --merge-lora: a plain Hugging Face GPT-2 computing what the adapted model does.
    out = export_checkpoint(tmp_path / "dora", tmp_path / "merged", merge_adapters=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = dora.engine.state.unwrapped_model.eval()  # type: ignore[union-attr]
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(ids)
        assert (expected - merged(ids).logits).abs().max() <= TOLERANCE


@pytest.mark.distributed
def test_zero3_adapters_resume_on_dp2_x_tp2_as_one_process_runs(
    base: tuple[PretrainingData, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data, base_dir = base
    extra = [*ADAPTERS, "--pretrained-checkpoint", str(base_dir), "--global-batch-size", "8"]
    _run(data, tmp_path / "one", *extra, "--train-iters", "8")

    def launch(ranks: int, save: str, *layout: str) -> str:
        return launched([
            "--nproc-per-node", str(ranks), "--task", "pretraining", *data.flags(), *FLAGS,
            *extra, "--train-iters", "8", "--save", str(tmp_path / save), *layout,
        ], capfd)  # fmt: skip

    # The same --train-iters everywhere: it sizes the corpus' sample index (Megatron's).
    launch(2, "zero3", "--sharding", "zero3", "--save-interval", "4")
    resumed = launch(
        4, "resumed", "--tensor-model-parallel-size", "2",
        "--load", str(tmp_path / "zero3" / "iter_0000004"),
    )  # fmt: skip
    assert "resumed from" in resumed and "vocab-parallel loss" in resumed
    one, zero3 = read_losses(tmp_path / "one"), read_losses(tmp_path / "zero3")
    tp = read_losses(tmp_path / "resumed")
    assert one.keys() == zero3.keys() == set(range(1, 9)) and tp.keys() == set(range(5, 9))
    assert max(abs(one[s] - zero3[s]) for s in one) <= TOLERANCE
    assert max(abs(one[s] - tp[s]) for s in tp) <= TOLERANCE


def test_qlora_and_the_finetuners_pretrained_checkpoint_are_refused_before_anything_is_built(
    base: tuple[PretrainingData, Path],
) -> None:
    from rapidformer.templates.finetuner import Finetuner

    data, base_dir = base
    flags = [*data.flags(), *FLAGS, *ADAPTERS, "--pretrained-checkpoint", str(base_dir),
             "--train-iters", "1", "--precision", "bf16", "--quantize-base", "nf4"]  # fmt: skip
    refused = Pretrainer.config_violations(parse_args(flags))
    assert any(v.flag == "--quantize-base" and "meta device" in v.rule for v in refused)
    finetuning = parse_args(["--task", "causal_lm", "--pretrained-model-name-or-path", "x",
                             "--pretrained-checkpoint", str(base_dir)])  # fmt: skip
    refused = Finetuner.config_violations(finetuning)
    assert any(v.flag == "--pretrained-checkpoint" for v in refused)
