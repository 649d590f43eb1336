"""How much memory one training step of the built-in GPT takes on a CPU, measured and as the
dry run estimates it: the dry run's accuracy check (its test and its benchmark).

A *spec* is ``{"config": {...RapidformerConfig fields}, "shape": {...GPTConfig fields}}``,
with ``"world_size": N`` for N ranks under torchrun (data parallel, as the config says). With
the config's document flags (``reset_attention_mask`` ...), micro-batches hold a document
boundary every ``DOCUMENT_EVERY`` tokens and carry the positions and mask the flags add.
With ``"llama": {...LlamaConfig fields}`` in place of ``"shape"``, the model is a transformers
Llama fine-tuned as ``--task causal_lm`` runs it: on rows of ``--seq-length`` tokens packed
from samples of ``DOCUMENT_EVERY`` tokens (``packing``: the positions and the block-diagonal
mask), or on samples padded to it (a tenth of each is padding).

**Measured** (:func:`measured_rise`): a child process trains through the engine with
``MALLOC_MMAP_THRESHOLD_`` set low, so that every large block is its own mapping, returned to
the kernel when freed, and the resident set follows the live tensors. Two steps first (the
optimizer's state exists afterwards; gradients are freed after each step, DDP's excepted),
then the measured step: its peak (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``)
minus the resident set at its start.

**Estimated** (:func:`estimated_rise`): the dry run's total for the rank minus what exists
before a step (parameters and optimizer state, and the gradients where DDP's buckets keep
them). The resident set also holds the allocator's small blocks and page rounding; the
estimate counts tensors.

    python -m rapidformer.testing.step_memory '{"config": {...}, "shape": {...}}'
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.data.documents import DOCUMENT_INPUTS, document_collate
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import StepFunctions

Spec = dict[str, Any]
DOCUMENT_EVERY = 97
"""Tokens between two ends of documents in the measured micro-batches."""
EOD = 0


def supported() -> bool:
    """Whether this machine can measure (Linux's ``/proc`` with a resettable peak)."""
    return Path("/proc/self/clear_refs").exists()


def estimated_rise(spec: Spec) -> int:
    """The dry run's estimate of how far a step rises above its start (bytes)."""
    from rapidformer.dryrun import dry_run, gpt_workload

    config = RapidformerConfig.from_dict(spec["config"])
    micro = config.data.micro_batch_size
    if "llama" in spec:
        import transformers

        from rapidformer.dryrun.finetuning import causal_lm_workload

        seq = config.model.seq_length
        assert seq is not None
        llama = transformers.LlamaConfig(**spec["llama"])
        work = causal_lm_workload(llama, micro, seq, packing=config.data.packing)
    else:
        documents = document_collate(config.data, EOD)
        work = gpt_workload(GPTConfig(**spec["shape"]), micro, documents)
    rank = dry_run(config, spec.get("world_size", 1), work, "GPT").ranks[0]
    kept = rank.state.gradients if rank.gradients_kept else 0
    return rank.total - rank.state.parameters - rank.state.optimizer - kept


def measured_rise(spec: Spec, timeout: float = 300) -> int:
    """How far a real step's resident set rises above its start (bytes; the most of any
    rank), in child processes with one torch thread each."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    ranks = int(spec.get("world_size", 1))
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    done = subprocess.run(
        [sys.executable, *(launch if ranks > 1 else []), "-m", __name__, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    results = re.findall(r"RESULT (\{[^}]*\})", done.stdout)
    if done.returncode != 0 or len(results) != ranks:
        raise RuntimeError(f"the measuring child failed:\n{done.stderr[-3000:]}")
    return max(int(json.loads(result)["rise"]) for result in results)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _child(spec: Spec) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = RapidformerConfig.from_dict(spec["config"])
    engine = RapidformerEngine(config, builds_optimizer=True)
    batch, step = (_llama_step if "llama" in spec else _gpt_step)(spec, config, engine)
    batches = [batch] * engine.accumulation_steps
    for _ in range(2):
        engine.run_step(batches, step)
    gc.collect()
    start = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    engine.run_step(batches, step)
    peak = _status_bytes("VmHWM")
    engine.close()
    # One write, so that two ranks' lines cannot interleave on torchrun's shared stdout.
    os.write(sys.stdout.fileno(), f"RESULT {json.dumps({'rise': peak - start})}\n".encode())


def _gpt_step(
    spec: Spec, config: RapidformerConfig, engine: RapidformerEngine
) -> tuple[dict[str, torch.Tensor], StepFunctions]:
    shape = GPTConfig(**spec["shape"])
    state = engine.compose(GPTModel.build(shape, "meta"))
    micro, seq = config.data.micro_batch_size, shape.max_position_embeddings
    ids = torch.randint(1, shape.vocab_size, (micro, seq))
    ids[:, DOCUMENT_EVERY::DOCUMENT_EVERY] = EOD
    batch = {"input_ids": ids, "labels": ids}
    documents = document_collate(config.data, EOD)
    if documents is not None:
        batch = documents.add_parts(batch)

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = state.model(**{key: batch[key] for key in DOCUMENT_INPUTS if key in batch})
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    return batch, StepFunctions(train_step=loss, weight=lambda b: b["labels"].numel())


def _llama_step(
    spec: Spec, config: RapidformerConfig, engine: RapidformerEngine
) -> tuple[dict[str, torch.Tensor], StepFunctions]:
    import transformers

    from rapidformer.data.packing import collate_packed, pack_rows
    from rapidformer.templates.tasks import CausalLM

    llama = transformers.LlamaConfig(**spec["llama"])
    llama._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(llama)
    micro, seq = config.data.micro_batch_size, config.model.seq_length
    assert seq is not None
    task: Any = CausalLM(SimpleNamespace(pad_token_id=0), seq)  # type: ignore[arg-type]
    ids = torch.randint(1, llama.vocab_size, (micro, seq))
    if config.data.packing:
        samples = [{"input_ids": ids[row, i : i + DOCUMENT_EVERY].tolist()}
                   for row in range(micro) for i in range(0, seq, DOCUMENT_EVERY)]  # fmt: skip
        batch = collate_packed(pack_rows(samples, seq)[:micro], seq, pad_id=0)
    else:
        mask = torch.ones_like(ids)
        mask[:, -seq // 10 :] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
    state = engine.compose(model)

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.loss(state.model(**task.inputs(batch)), batch)

    return batch, StepFunctions(train_step=loss, weight=task.weight)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
