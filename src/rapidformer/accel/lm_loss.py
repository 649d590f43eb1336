"""``--fused-lm-loss``: the switch on the model's forward, and where it cannot run.

The loss itself is :func:`rapidformer.models.fused_loss.fused_linear_cross_entropy`; the
built-in GPT and BERT call it inside their forward when this switch is on and the templates
pass the labels (so every sharding engine has the head's parameters gathered there).
"""

from __future__ import annotations

from collections.abc import Iterator

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.models import hf_fused_loss
from rapidformer.models.fused_loss import chunk_tokens, liger_available
from rapidformer.state import PlanStep, TrainState


def apply_fused_lm_loss(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """Tell the model to compute its head and loss inside its forward (the built-in GPT and
    BERT take the labels then); refuse a model that cannot."""
    if not config.memory.fused_lm_loss:
        return state
    model = state.unwrapped_model
    if not hasattr(model, "fused_lm_loss") and hf_fused_loss.supports(model):
        hf_fused_loss.patch_forward(model)
        state.plan.append(PlanStep("fused LM loss", _engine(state), _detail(state)))
        return state
    parts = [part for part in state.model_parts if hasattr(part, "fused_lm_loss")]
    if not parts:
        raise ConfigError.single(
            "--fused-lm-loss",
            True,
            f"{type(state.unwrapped_model).__name__} does not compute its LM loss in its "
            "forward (the built-in GPT and BERT do, and Hugging Face causal LMs of the "
            f"families {', '.join(hf_fused_loss.FAMILIES)})",
            "drop --fused-lm-loss",
        )
    for part in parts:
        part.fused_lm_loss = True  # type: ignore[assignment]
    state.plan.append(PlanStep("fused LM loss", _engine(state), _detail(state)))
    return state


def _engine(state: TrainState) -> str:
    return "Liger-Kernel (Triton)" if liger_available(state.device) else "torch, chunked"


def _detail(state: TrainState) -> str:
    if liger_available(state.device):
        return "Liger's fused linear cross-entropy: the head and the loss in one kernel pass"
    vocab = getattr(getattr(state.unwrapped_model, "config", None), "vocab_size", None)
    detail = "head and cross-entropy in chunks of tokens, logits recomputed in backward"
    if vocab:
        detail += f" ({chunk_tokens(vocab)} tokens per chunk at vocabulary {vocab})"
    return detail


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """Where the chunked loss cannot run."""
    if not config.memory.fused_lm_loss:
        return
    flag, dims = "--fused-lm-loss", context.dims
    if not context.runs_loop:
        yield Violation(
            flag,
            True,
            "the templates pass the labels to the model; a hand-written loop would still "
            "compute the loss from full logits",
            "call rapidformer.models.fused_loss.fused_linear_cross_entropy in your loss, or "
            "subclass Pretrainer / Finetuner",
        )
    if dims.tp > 1:
        yield Violation(
            flag,
            True,
            f"cannot run with --tensor-model-parallel-size {dims.tp}: the vocabulary-parallel "
            "head's loss runs through torch's loss_parallel over sharded logits, which already "
            "never gathers them",
            f"drop {flag} (tensor parallelism bounds the logits per rank)",
        )
    if dims.pp > 1:
        yield Violation(
            flag,
            True,
            f"cannot run with --pipeline-model-parallel-size {dims.pp}: the last stage hands "
            "logits to the schedule's loss",
            f"drop {flag}, or use --pipeline-model-parallel-size 1",
        )


FEATURE = Feature(
    "fused LM loss",
    flags=("--fused-lm-loss",),
    rules=rules,
    switched_on=lambda config: True if config.memory.fused_lm_loss else None,
    refused_on={
        "deepspeed": "DeepSpeed ZeRO gathers a layer's weights only around that layer's own "
        "forward, and the fused loss reads the head's weight from the model's"
    },
)
