"""What of rapidformer's parallelism a Hugging Face model supports, decided before anything is
built (no process group, no weights: config.json at most), so that the Finetuner's validation
refuses the rest with the other flags' violations, each with its fix.

- MoE flags (``--num-experts``, ``--moe-use-upcycling``) swap the FFNs of the built-in GPT/BERT;
  a Hugging Face model keeps its own architecture (its MoE families route by themselves).
- Pipeline stages are cut from the built-in models only.
- Tensor parallelism needs the model's own plan (``base_model_tp_plan`` in its config), which
  ``transformers`` applies while loading.

This sits in ``templates/`` rather than ``models/`` because its fix names the families that
ship a plan, which the tensor-parallel acceleration owns (:data:`HF_TP_FAMILIES`).
"""

from __future__ import annotations

from rapidformer.accel.tensor_parallel import HF_TP_FAMILIES
from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import Violation
from rapidformer.models.hf import tp_plan_of


def hf_parallel_violations(config: RapidformerConfig) -> list[Violation]:
    """The parallelism flags in ``config`` that a Hugging Face model cannot honour."""
    parallel, path = config.parallel, config.model.pretrained_model_name_or_path
    violations = []
    moe = config.moe
    if (moe.num_experts or 1) > 1 or moe.moe_use_upcycling:
        flag = "--num-experts" if (moe.num_experts or 1) > 1 else "--moe-use-upcycling"
        violations.append(
            Violation(
                flag,
                moe.num_experts if flag == "--num-experts" else True,
                "swaps the FFNs of rapidformer's built-in GPT/BERT; a Hugging Face model keeps "
                "its own architecture",
                "fine-tune a Hugging Face MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE: its router "
                "loss is included by itself) without the flag, or pretrain the built-in GPT/BERT "
                "with --num-experts (and --moe-use-upcycling --load DENSE_CHECKPOINT)",
            )
        )
    if parallel.pipeline_model_parallel_size > 1:
        violations.append(
            Violation(
                "--pipeline-model-parallel-size",
                parallel.pipeline_model_parallel_size,
                "pipeline stages are cut from the built-in GPT/BERT, not from Hugging Face models",
                "pretrain with the built-in models (--task pretraining), or use "
                "--tensor-model-parallel-size / ZeRO for fine-tuning",
            )
        )
    if (
        parallel.tensor_model_parallel_size > 1
        and path is not None
        and not tp_plan_of(path, config.model.trust_remote_code)
    ):
        violations.append(
            Violation(
                "--tensor-model-parallel-size",
                parallel.tensor_model_parallel_size,
                f"the model in {path} ships no tensor-parallel plan (base_model_tp_plan); "
                "GPT-2, BERT, RoBERTa and T5 have none",
                f"fine-tune a family that has one ({HF_TP_FAMILIES}), use ZeRO / FSDP "
                "instead, or pretrain with the built-in GPT/BERT, which split themselves",
            )
        )
    return violations
