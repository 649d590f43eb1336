"""``--liger-kernel``: Liger-Kernel's Triton kernels in Hugging Face models on CUDA.

Hugging Face decoders run RMSNorm, rotary embeddings and the SwiGLU MLP as many small
kernels; Liger's per-family patch swaps them for fused Triton kernels in the model instance
(``apply_liger_kernel_to_<family>(model=...)``), as transformers' own Trainer does with
``use_liger_kernel``. rapidformer applies RMSNorm, RoPE and SwiGLU; Liger's fused linear
cross-entropy replaces a model's forward only when the model computes its own loss from
labels, which the Finetuner does not (it takes the logits), so that one stays off and the plan
says so. The families are those of :data:`FAMILIES`.

Refused before anything is built: Liger not installed, no CUDA device, or (in the Finetuner,
which reads the model's ``config.json``) a family Liger has no patch for. At compose, a model
that is not a Hugging Face model of such a family is refused, naming its class.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

import torch
from torch import nn

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.state import PlanStep, TrainState

FAMILIES = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "mixtral": "apply_liger_kernel_to_mixtral",
    "gemma": "apply_liger_kernel_to_gemma",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "phi3": "apply_liger_kernel_to_phi3",
    "granite": "apply_liger_kernel_to_granite",
    "olmo2": "apply_liger_kernel_to_olmo2",
}
"""model_type -> Liger's patch function for it (in ``liger_kernel.transformers``)."""
PATCHED = {"rope": True, "rms_norm": True, "swiglu": True}
"""The kernels applied; the losses stay off (the Finetuner computes them from logits)."""
UNPATCHED = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def family_violation(model_type: str | None) -> Violation | None:
    """A violation when Liger has no patch for ``model_type``."""
    if model_type is None or model_type in FAMILIES:
        return None
    return Violation(
        "--liger-kernel",
        True,
        f"Liger-Kernel has no patch for {model_type} models (it has: "
        f"{', '.join(sorted(FAMILIES))})",
        "drop --liger-kernel",
    )


def apply_liger_kernel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    if not config.graph.liger_kernel:
        return state
    model: nn.Module = state.unwrapped_model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not hasattr(model, "base_model_prefix") or model_type is None:  # a PreTrainedModel
        raise ConfigError.single(
            "--liger-kernel",
            True,
            f"{type(model).__name__} is not a Hugging Face model; Liger patches those",
            "drop --liger-kernel (the built-in models have their own layers)",
        )
    violation = family_violation(model_type)
    if violation is not None:
        raise ConfigError([violation])
    module = importlib.import_module("liger_kernel.transformers")
    patch = getattr(module, FAMILIES[model_type])
    patch(model=model, **PATCHED, **UNPATCHED)
    state.plan.append(
        PlanStep(
            "Liger-Kernel",
            f"liger_kernel.transformers.{FAMILIES[model_type]}",
            "RMSNorm, RoPE and SwiGLU as Triton kernels in this model; its cross-entropy "
            "losses off (the Finetuner computes the loss from the logits)",
        )
    )
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    if not config.graph.liger_kernel or not context.on_this_machine:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        yield Violation(
            "--liger-kernel",
            True,
            "Liger-Kernel is not installed",
            "pip install 'rapidformer[gpu]'",
        )
    if not torch.cuda.is_available():
        yield Violation(
            "--liger-kernel",
            True,
            "Liger-Kernel's kernels are Triton kernels for CUDA; this machine has no CUDA device",
            "drop --liger-kernel",
        )


FEATURE = Feature("Liger-Kernel", flags=("--liger-kernel",), rules=rules)
