"""``rapidformer ... --dry-run``: the command users run, at the size they ask about.

GPT-1.3B (PAI's shape) on 16 simulated ranks: in seconds, in a process that never holds the
model (its peak resident set stays far below the model's 5 GiB of fp32 parameters), without
data files, a process group or another process, and with the per-rank model state that the
meta-device cut of ``benchmarks/memory_3d.py`` counts. With a 24 GB device and no parallelism
it does not fit, and the switches it lists are each a dry run of their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rapidformer import parse_args
from rapidformer.cli import main
from rapidformer.dryrun.command import run_dry_run
from rapidformer.models.gpt import GPTConfig

ROOT = Path(__file__).resolve().parents[2]
GPT_1_3B = [
    "--task", "pretraining", "--num-layers", "24", "--hidden-size", "2048",
    "--num-attention-heads", "32", "--seq-length", "1024", "--tokenizer-type",
    "GPT2BPETokenizer", "--vocab-file", "no/vocab.json", "--merge-file", "no/merges.txt",
    "--data-path", "no/corpus", "--micro-batch-size", "1", "--lr", "1e-4",
    "--train-iters", "100", "--dry-run",
]  # fmt: skip
GIB = 2**30


def _command(*flags: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    """``rapidformer`` in its own process (no MASTER_ADDR: no rendezvous is possible), and the
    seconds it took; it prints its own peak resident set last."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rapidformer.cli import main\n"
        "code = main(sys.argv[1:])\n"
        # VmHWM, not ru_maxrss: the latter keeps the pytest parent's resident set at the fork.
        "hwm = [l for l in Path('/proc/self/status').read_text().splitlines() if 'VmHWM' in l]\n"
        "print('PEAK_RSS_KIB', hwm[0].split()[1])\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *flags],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip
    return done, time.perf_counter() - started


def _memory_3d() -> Any:
    spec = importlib.util.spec_from_file_location("memory_3d", ROOT / "benchmarks/memory_3d.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_gpt_1_3b_on_4x4_is_planned_in_seconds_without_memory_data_or_peers(
    tmp_path: Path,
) -> None:
    layout = ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4"]
    done, seconds = _command(
        *GPT_1_3B, *layout, "--global-batch-size", "4", "--precision", "fp16",
        "--dry-run-world-size", "16", "--save", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert seconds < 60, seconds  # ~5 s here; the bound leaves room for a busy CI machine
    peak_gib = int(done.stdout.split("PEAK_RSS_KIB")[1]) * 1024 / GIB
    assert peak_gib < 2.0, peak_gib  # the model's fp32 parameters alone are 4.9 GiB
    assert "dp 1 x tp 4 x pp 4" in done.stdout and "1F1B" in done.stdout
    assert "does not exist (a real run would stop there)" in done.stdout  # no data was read
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert [rank["rank"] for rank in report["ranks"]] == list(range(16))

    # The model state of every rank is what memory_3d's cut of the same model holds: 16 bytes
    # per parameter (fp16 mixed-precision Adam there; fp32 weights, gradients and two Adam
    # moments here: the same 16).
    memory_3d = _memory_3d()
    shape = GPTConfig(
        vocab_size=50257, num_layers=24, hidden_size=2048, num_attention_heads=32,
        max_position_embeddings=1024,
    )  # fmt: skip
    for rank in report["ranks"]:
        held = memory_3d.held_parameters(shape, 4, 4, rank["rank"])
        assert rank["state"]["total"] == 16 * held, rank["rank"]
    worst = max(report["ranks"], key=lambda r: r["total"])
    assert report["worst_rank"] == worst["rank"]
    # 1F1B: the first stage holds four micro-batches in flight, the last one.
    in_flight = {r["position"]["pp"]: r["in_flight"] for r in report["ranks"]}
    assert in_flight == {0: 4, 1: 3, 2: 2, 3: 1}
    assert re.search(r"worst rank 0 .*total \d+\.\d\d = model state", done.stdout)


def test_a_device_too_small_gets_the_switches_that_make_it_fit() -> None:
    flags = [*GPT_1_3B, "--micro-batch-size", "4", "--global-batch-size", "64"]
    flags += ["--dry-run-world-size", "16", "--device-memory", "24GB"]
    report = run_dry_run(parse_args(flags))
    assert report.fits is False and report.device_memory == 24 * GIB
    names = [s.switches for s in report.suggestions]
    assert names[0] == "bf16" and names[-1].endswith("ZeRO-2"), names
    assert [s.fits for s in report.suggestions] == [False] * (len(names) - 1) + [True]
    totals = [s.worst_total for s in report.suggestions]
    assert totals == sorted(totals, reverse=True) and totals[0] < report.worst.total
    # Each suggestion is the dry run of its own flags.
    last = report.suggestions[-1]
    again = run_dry_run(parse_args([*flags, *" ".join(last.flags).split()]))
    assert again.worst.total == last.worst_total and again.fits
    text = report.text()
    assert "does NOT fit" in text and "--sharding zero2" in text


def test_no_parallelism_on_one_24gb_gpu_climbs_to_recomputation() -> None:
    flags = [*GPT_1_3B, "--micro-batch-size", "4", "--global-batch-size", "4"]
    report = run_dry_run(parse_args([*flags, "--device-memory", "24GiB"]))
    assert not report.fits
    names = [s.switches for s in report.suggestions]
    # One rank: no ZeRO rung applies; recomputation is what saves memory there.
    assert names == ["bf16", "bf16 + selective recompute", "bf16 + full recompute"], names
    assert report.suggestions[-1].fits


def test_a_bad_device_memory_is_refused_before_anything_is_built(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    assert main([*GPT_1_3B, "--device-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory='lots'" in err and "80GB" in err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - before < 5


def test_bad_flags_fail_the_dry_run_as_they_fail_a_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*GPT_1_3B, "--tensor-model-parallel-size", "3", "--dry-run-world-size", "4"])
    assert code == 2
    assert "--tensor-model-parallel-size=3" in capsys.readouterr().err


def test_fine_tuning_tasks_but_causal_lm_are_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["--task", "sequence_classification", "--pretrained-model-name-or-path", "m",
                 "--data-name", "x", "--micro-batch-size", "2", "--lr", "1e-4", "--epochs",
                 "1", "--dry-run"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and "--task causal_lm or pretraining" in err


def test_a_causal_lm_is_planned_from_its_config_packed_rows_and_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--task causal_lm: the model from config.json on the meta device (no weights read), the
    recipe's defaults filled in as a run fills them, packed rows or padded samples (how close
    the estimates come to a measured step: tests/dryrun/test_activations.py); a Hugging Face
    model's tensor parallelism is refused with the reason."""
    from rapidformer.testing.families import tiny_model

    model = tiny_model("llama", tmp_path / "llama", hidden=64, max_positions=256)
    (model / "model.safetensors").unlink()  # the weights are never read
    flags = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model),
             "--data-dir", str(tmp_path / "chat"), "--seq-length", "256",
             "--micro-batch-size", "4", "--dry-run", "--save", str(tmp_path / "run")]  # fmt: skip
    activations = {}
    for packing in ([], ["--packing"]):
        assert main([*flags, *packing]) == 0
        said = capsys.readouterr().out
        report = json.loads((tmp_path / "run" / "dry_run.json").read_text())
        activations[bool(packing)] = report["ranks"][0]["activations"]
        assert "LlamaForCausalLM from" in said and "--data-dir" in said  # no such directory
        shape = "4 packed rows of 256 tokens" if packing else "4 samples padded to 256 tokens"
        assert shape in said
        # A small model's figures in MiB (in GiB each read 0.00), one micro-batch in the singular.
        assert "memory per rank (MiB;" in said and "0.00 MiB" not in said, said
        assert "1 micro-batch per step per rank" in said, said
    assert activations[True] != activations[False] and all(activations.values())
    assert main([*flags, "--tensor-model-parallel-size", "2", "--dry-run-world-size", "2"]) == 2
    assert "tensor-parallel plan while its weights load" in capsys.readouterr().err


def test_a_packed_plan_counts_the_rows_and_micro_batches_an_epoch_packs_into(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --packing and data, the plan reads the training split and says how many rows of
    --seq-length tokens it packs into: best-fit decreasing over the samples' token counts
    (each text and its end-of-sequence token), counted here from the tokenizer alone; on two
    data-parallel ranks, each rank's equal share. A model directory without a tokenizer is
    still planned, the count left out with the reason."""
    from transformers import AutoTokenizer

    from rapidformer.data.packing import best_fit_decreasing
    from rapidformer.testing.families import tiny_model
    from rapidformer.testing.finetune import task_dataset

    model = tiny_model("llama", tmp_path / "llama", hidden=64, max_positions=256)
    (model / "model.safetensors").unlink()  # the weights are never read
    data = task_dataset("causal_lm", tmp_path / "data", train=40, validation=8)
    lines = (data / "train.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    flags = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model),
             "--data-dir", str(data), "--seq-length", "64", "--micro-batch-size", "4",
             "--packing", "--dry-run", "--save", str(tmp_path / "run")]  # fmt: skip
    assert main(flags) == 0
    said = capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(tokenizer(t + tokenizer.eos_token)["input_ids"]) for t in texts]
    assert max(lengths) <= 64 and sum(lengths) > 3 * 64  # none cut; several rows
    rows = len(best_fit_decreasing(lengths, 64))
    assert f"an epoch: train: 40 samples packed into {rows} rows of 64 tokens" in said
    assert f"filled); {-(-rows // 4)} micro-batches of up to 4 rows\n" in said
    assert main([*flags, "--dry-run-world-size", "2"]) == 0
    said, share = capsys.readouterr().out, rows // 2
    left = f" ({rows % 2} left out)" if rows % 2 else ""
    assert (f"{share} rows in {-(-share // 4)} micro-batches of up to 4 rows on each of 2 "
            f"data-parallel ranks{left}\n") in said  # fmt: skip
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model / "config.json").read_text())
    assert main([*flags, "--pretrained-model-name-or-path", str(bare)]) == 0
    said = capsys.readouterr().out
    assert "; an epoch:" not in said
    assert "the rows an epoch packs into were not counted" in said
    assert "without running code): holds no usable tokenizer" in said


def test_the_planning_flags_without_a_dry_run_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = [f for f in GPT_1_3B if f != "--dry-run"]
    assert main([*flags, "--device-memory", "80GB", "--dry-run-world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory='80GB': only a dry run reads it" in err
    assert "--dry-run-world-size=8" in err


def test_rules_about_this_machine_do_not_bind_a_plan_for_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fp16 under DeepSpeed and fp8 need GPUs: refused for a run on this CPU, planned by a dry
    run (which is for the GPUs elsewhere)."""
    small = [*GPT_1_3B, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
             "4", "--seq-length", "32", "--global-batch-size", "2", "--dry-run-world-size",
             "2"]  # fmt: skip
    gpu_only = [
        ["--zero-backend", "deepspeed", "--zero-2-memory-optimization", "--mixed-precision"],
        ["--precision", "fp8"],
    ]
    for flags in gpu_only:
        report = run_dry_run(parse_args([*small, *flags]))
        assert report.ranks and report.worst.total > 0, flags
        real = [f for f in [*small, *flags] if f != "--dry-run"]
        real = [f for i, f in enumerate(real) if not (f == "--dry-run-world-size" or
                (i and real[i - 1] == "--dry-run-world-size"))]  # fmt: skip
        assert main(real) == 2, flags
        assert "GPU" in capsys.readouterr().err


def test_a_process_that_already_has_a_process_group_keeps_it() -> None:
    """A notebook that trained, or a DeepSpeed engine's group of one (which stays for the
    process's lifetime): the dry run sets that group aside for its fake ranks and puts it
    back untouched."""
    code = (
        "import torch.distributed as dist\n"
        "from rapidformer import parse_args\n"
        "from rapidformer.dryrun.command import run_dry_run\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "outer = dist.group.WORLD\n"
        f"flags = {[*GPT_1_3B, '--num-layers', '2', '--hidden-size', '64']!r}\n"
        "flags += ['--num-attention-heads', '4', '--seq-length', '32', '--global-batch-size',\n"
        "          '8', '--dry-run-world-size', '4', '--tensor-model-parallel-size', '2']\n"
        "report = run_dry_run(parse_args(flags))\n"
        "assert len(report.ranks) == 4 and dist.group.WORLD is outer\n"
        "dist.barrier()\n"
        "assert dist.get_rank() == 0 and dist.get_rank(outer) == 0\n"
        "import torch, torch.distributed.checkpoint as dcp, tempfile\n"
        "dcp.save({'x': torch.ones(2)}, checkpoint_id=tempfile.mkdtemp())  # reads the group\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "assert funcol.all_reduce(torch.ones(1), 'sum', outer).item() == 1  # by its name\n"
        "print('KEPT', dist.get_world_size())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "KEPT 1" in done.stdout, done.stderr[-3000:]
