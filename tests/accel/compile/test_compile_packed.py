"""Packed rows have one shape whatever samples they hold: a Hugging Face Llama compiled per block
runs 20 steps of varied packed samples with one block graph, no fallback, no host read, and the
losses of eager (the backend is dynamo's ``eager``: the same graphs and guards, no kernels), with
transformers' sdpa and with rapidformer's per-sample attention (which compiles as sdpa over the
whole mask, while eager runs each sample alone)."""

from __future__ import annotations

import pytest
import torch
import transformers

from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions
from rapidformer.data.packing import collate_packed, pack_rows
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models import packed_attention
from rapidformer.templates.tasks import CausalLM
from tests.helpers.host_reads import counting_host_reads

LENGTH, STEPS = 48, 20


pytestmark = pytest.mark.usefixtures("eager_backend")


def _batches() -> list[dict[str, torch.Tensor]]:
    """Each step a different set of samples (3 to 30 tokens), packed into 2 rows."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        lengths = torch.randint(3, 31, (5,), generator=generator).tolist()
        samples = [{"input_ids": torch.randint(1, 128, (n,), generator=generator).tolist()}
                   for n in lengths]  # fmt: skip
        rows = pack_rows(samples, LENGTH)[:2]
        batches.append(collate_packed(rows + rows[:1] * (2 - len(rows)), LENGTH, pad_id=0))
    return batches


def _train(compiled: bool, attention: str) -> tuple[RapidformerEngine, list[float], int]:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    task = CausalLM.__new__(CausalLM)  # only its inputs and loss are used: no tokenizer
    if attention == packed_attention.NAME:
        task.per_sample_attention = packed_attention.prepare_packed(model, torch.device("cpu"))
        assert task.per_sample_attention
    engine = RapidformerEngine(RapidformerConfig.from_dict({"lr": 1e-3, "torch_compile": compiled}))
    state = engine.compose(model)

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.loss(state.model(**task.inputs(batch)), batch)

    def weight(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    step = StepFunctions(train_step=loss, weight=weight)
    with counting_host_reads() as reads:
        results = [engine.run_step([batch], step) for batch in _batches()]
    return engine, [float(r.loss) for r in results], reads.total()


@pytest.mark.parametrize("attention", ["sdpa", packed_attention.NAME])
def test_packed_rows_compile_once_and_read_nothing_on_the_host(attention: str) -> None:
    compiled, losses, reads = _train(compiled=True, attention=attention)
    assert compiled.step_metrics() == {"compile_graphs": 1, "compile_fallbacks": 0}
    assert reads == 0
    compiled.close()
    eager, reference, _ = _train(compiled=False, attention=attention)
    eager.close()
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-5
    assert losses[-1] < losses[0]
