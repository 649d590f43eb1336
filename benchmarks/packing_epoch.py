"""One epoch of the packing benchmark's workload, as each mode lays it out: the samples
(long-tailed lengths like FLAN's), the micro-batches of each mode, the small Llama, and
:class:`EpochRun`, which trains an epoch a step at a time and says how fast it went.
``benchmarks/packing.py`` (the CPU) and ``benchmarks/gpu/finetuning.py`` (a GPU) run it."""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODES = ("padded", "buckets", "packed")
SEQ, VOCAB, MICRO_BATCH, PACKED_ROWS, HELD_OUT = 512, 4096, 8, 2, 64


def corpus(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``count`` samples with long-tailed lengths (8 to SEQ tokens) of Markov-ish token ids."""
    rng = np.random.RandomState(seed)
    lengths = np.clip(rng.lognormal(mean=4.2, sigma=0.9, size=count), 8, SEQ).astype(int)
    samples = []
    for length in lengths:
        start = rng.randint(1, VOCAB)
        steps = rng.randint(1, 17, size=int(length))  # learnable: small steps through the ids
        ids = (start + np.cumsum(steps)) % (VOCAB - 1) + 1
        samples.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids)})
    return samples


def batches(
    mode: str, samples: list[dict[str, list[int]]], seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """One epoch's micro-batches, as ``mode`` lays them out, in the order of ``seed``."""
    from rapidformer.data.dynamic_shape import BucketCollate, LengthGroupedSampler, bucket_lengths
    from rapidformer.data.packing import collate_packed, pack_rows
    from rapidformer.data.samplers import ResumableDistributedSampler
    from rapidformer.templates.tasks import CausalLM

    task = CausalLM(SimpleNamespace(pad_token_id=0), SEQ)  # type: ignore[arg-type]
    if mode.startswith("packed"):
        rows = pack_rows(samples, SEQ)
        sampler = ResumableDistributedSampler(len(rows), micro_batch_size=PACKED_ROWS, seed=seed)
        order = list(sampler)
        return [collate_packed([rows[i] for i in order[s : s + PACKED_ROWS]], SEQ, 0)
                for s in range(0, len(order), PACKED_ROWS)]  # fmt: skip
    if mode == "buckets":
        lengths = [len(s["input_ids"]) for s in samples]
        order = list(LengthGroupedSampler(lengths, MICRO_BATCH, seed=seed))
        collate: Any = BucketCollate(task.collate, bucket_lengths(SEQ))
    else:
        order = list(
            ResumableDistributedSampler(len(samples), micro_batch_size=MICRO_BATCH, seed=seed)
        )

        def collate(group: list[Any]) -> Any:
            return task.collate(group, pad_to=max(len(s["input_ids"]) for s in group))

    return [collate([samples[i] for i in order[s : s + MICRO_BATCH]])
            for s in range(0, len(order), MICRO_BATCH)]  # fmt: skip


def llama() -> Callable[[], torch.nn.Module]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ,
    )  # fmt: skip
    return lambda: transformers.LlamaForCausalLM(config)


class EpochRun:
    """One epoch of ``epoch``'s micro-batches (made of ``samples``) through the engine
    (AdamW, lr 1e-3, ``options``) on the device it picks, from the weights ``build_model``
    makes after seeding, a step at a time (so that several can interleave), then the loss on
    ``held_out`` one by one. Built, it has run a forward and backward of each shape the epoch
    holds, and a warm-up step (the optimizer's state). ``per_sample_attention``: packed rows
    run as ``--packing`` runs them (one sample at a time on the CPU, the whole mask
    elsewhere); else through sdpa over the whole mask."""

    def __init__(
        self,
        epoch: list[dict[str, torch.Tensor]],
        samples: list[dict[str, list[int]]],
        held_out: list[dict[str, list[int]]],
        build_model: Callable[[], torch.nn.Module],
        options: dict[str, Any],
        per_sample_attention: bool = False,
    ) -> None:
        from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions
        from rapidformer.models.packed_attention import prepare_packed
        from rapidformer.templates.tasks import CausalLM

        torch.manual_seed(0)
        model = build_model()
        self.engine = RapidformerEngine(
            RapidformerConfig.from_dict({"lr": 1e-3, **options}), builds_optimizer=True
        )
        self.device = self.engine.device
        task = CausalLM(SimpleNamespace(pad_token_id=0), SEQ)  # type: ignore[arg-type]
        task.per_sample_attention = per_sample_attention and prepare_packed(model, self.device)
        self.state = state = self.engine.compose(model)
        self.epoch = [{key: value.to(self.device) for key, value in batch.items()}
                      for batch in epoch]  # fmt: skip
        self.samples, self.held_out = samples, held_out

        def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return task.loss(state.model(**task.inputs(batch)), batch)

        self.functions = StepFunctions(train_step=loss, weight=task.weight)
        # The timed epoch runs as a later epoch of a run does: each of its shapes has run a
        # forward and backward once (the first time a shape comes, its buffers are new to the
        # allocator), with no update, so that every mode learns from the same samples.
        for batch in {tuple(b["input_ids"].shape): b for b in self.epoch}.values():
            state.forward_backward.run(
                state, [batch], self.functions, torch.ones(1, device=self.device)
            )
        model.zero_grad(set_to_none=True)
        self.engine.run_step([self.epoch[0]], self.functions)  # the optimizer's state
        self.losses: list[torch.Tensor] = []
        self.seconds = 0.0
        self.minor_faults = 0  # pages the kernel mapped in during the steps (fresh buffers)

    @property
    def done(self) -> bool:
        return len(self.losses) == len(self.epoch)

    @property
    def progress(self) -> float:
        return len(self.losses) / len(self.epoch)

    def step(self) -> bool:
        """The next micro-batch, timed; whether any is left."""
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        synchronize()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        batch = self.epoch[len(self.losses)]
        self.losses.append(self.engine.run_step([batch], self.functions).loss_tensor)
        synchronize()
        self.seconds += time.perf_counter() - started
        self.minor_faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return not self.done

    def finish(self) -> dict[str, Any]:
        from rapidformer.state import evaluation_context

        learned = sum(len(s["input_ids"]) - 1 for s in self.samples)
        total, tokens = 0.0, 0
        with evaluation_context(self.state):  # no gradients, the training precision
            for sample in self.held_out:
                ids = torch.tensor([sample["input_ids"]], device=self.device)
                logits = self.state.unwrapped_model(input_ids=ids).logits[0, :-1].float()
                total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                tokens += ids.shape[1] - 1
        slots = sum(int(b["input_ids"].numel()) for b in self.epoch)
        self.engine.close()
        return {
            "micro_batches": len(self.epoch),
            "padding": 1 - (learned + len(self.samples)) / slots,
            "seconds": self.seconds,
            "learned_tokens_per_s": learned / self.seconds,
            "minor_faults_per_step": self.minor_faults / len(self.epoch),
            "eval_loss": total / tokens,
            "first_loss": float(self.losses[0]),
            "last_loss": float(self.losses[-1]),
            "device": self.device,
        }


def train_epoch(
    epoch: list[dict[str, torch.Tensor]],
    samples: list[dict[str, list[int]]],
    held_out: list[dict[str, list[int]]],
    build_model: Callable[[], torch.nn.Module],
    options: dict[str, Any],
    on_start: Callable[[torch.device], None],
    per_sample_attention: bool = False,
) -> dict[str, Any]:
    """:class:`EpochRun` from start to end; ``on_start`` runs just before the timed epoch
    (after the warm-up step): where the caller starts its peak memory."""
    run = EpochRun(epoch, samples, held_out, build_model, options, per_sample_attention)
    gc.collect()
    on_start(run.device)
    while run.step():
        pass
    return run.finish()
