"""Child process of test_activations.py: trains a built-in GPT on the CPU through the engine and
prints how far one step's resident set rises above where it starts.

Run with ``MALLOC_MMAP_THRESHOLD_`` set low, so that every large block is its own mapping,
returned to the kernel when freed: the resident set then follows the live tensors. Two steps
first (the optimizer's state exists afterwards, gradients are freed after each step), then the
step measured: the peak (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``) minus the
resident set at its start.

    python tests/dryrun/peak_child.py '{"config": {...}, "shape": {...}}'
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import StepFunctions


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def main(spec: dict) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = RapidformerConfig.from_dict(spec["config"])
    shape = GPTConfig(**spec["shape"])
    engine = RapidformerEngine(config, builds_optimizer=True)
    state = engine.compose(GPTModel.build(shape, "meta"))
    micro, seq = config.data.micro_batch_size, shape.max_position_embeddings
    ids = torch.randint(0, shape.vocab_size, (micro, seq))

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = state.model(batch)
        return F.cross_entropy(logits.float().flatten(0, 1), batch.flatten())

    batches = [ids] * engine.accumulation_steps
    step = StepFunctions(train_step=loss, weight=lambda b: b.numel())
    for _ in range(2):
        engine.run_step(batches, step)
    gc.collect()
    start = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    engine.run_step(batches, step)
    peak = _status_bytes("VmHWM")
    engine.close()
    print("RESULT " + json.dumps({"rise": peak - start}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
