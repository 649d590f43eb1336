"""The dry run counts adapters as the run's memory report does: frozen base parameters
without gradients or optimizer state (in NF4 under QLoRA), the adapters with both (byte for
byte, a Hugging Face Llama composed on the meta device as a dry run composes each rank, against
the same model composed for real). The dry run's activation pass covers the built-in models
only (a Hugging Face forward reads values on the meta device), so the model state is compared
here."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.dryrun.simulate import compose_on_meta, fake_world
from rapidformer.engine.validation import validate

# Hidden 256: every projection's weight is a whole number of NF4 blocks (64 x 256 values); the
# rest of the base is bf16 under QLoRA.
CONFIG = transformers.LlamaConfig(
    vocab_size=128, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
BASE = {"lr": 1e-3, "train_iters": 1, "micro_batch_size": 2, "lora_rank": 4}
VARIANTS = {
    "dora": {"lora_variant": "dora"},
    "qlora": {"quantize_base": "nf4", "precision": "bf16"},
}


def _llama(device: str) -> nn.Module:
    with torch.device(device):
        return transformers.LlamaForCausalLM(CONFIG)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_dry_run_counts_the_adapters_as_the_memory_report_does(variant: str) -> None:
    if variant == "qlora":
        pytest.importorskip("torchao")
    options = {**BASE, **VARIANTS[variant]}
    engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
    state = engine.compose(_llama("cpu"))
    held, _ = state.stepper.expected_bytes(state)
    engine.close()
    trainable = sum(p.numel() * 4 for p in state.parameters if p.requires_grad)
    assert held.gradients == trainable and held.optimizer == 2 * trainable  # AdamW's moments

    config = RapidformerConfig.from_dict({**options, "dry_run": True})
    dims = validate(config, 1, rank=0, builds_optimizer=True, runs_loop=True)
    with fake_world(1, 0):
        meta = compose_on_meta(config, dims, lambda: _llama("meta"))
        simulated, _ = meta.stepper.expected_bytes(meta)
    assert simulated == held
    assert simulated.parameters == held.parameters
    assert any(str(step).startswith(f"adapters: {options.get('lora_variant', 'lora')}")
               for step in meta.plan)  # fmt: skip
    if variant == "qlora":  # the bytes NF4 holds: well under a bf16 base
        bf16 = sum(p.numel() * 2 for p in state.parameters if not p.requires_grad)
        assert held.parameters < 0.75 * bf16 + trainable
