"""``--precision fp8``: float8 matmuls in the linear layers, through torchao's float8 training.

The model runs under bf16 autocast (``accel/precision.py``) and each eligible ``nn.Linear``
becomes torchao's ``Float8Linear``: its three matmuls (output, input gradient, weight
gradient) cast their operands to float8 with dynamic scales (``--fp8-recipe tensorwise``: one
scale per tensor; ``rowwise``: one per row) and run on the GPU's float8 tensor cores
(compute capability 8.9 and newer: Ada, Hopper, Blackwell). Weights, gradients and optimizer
state stay as they were; only the matmuls change.

Eligible: every linear layer whose input and output features are both multiples of 16 (what
float8 matmuls need), except the LM head (its output is the vocabulary; a head tied to the
embedding keeps the embedding's precision). The plan lists how many layers were converted and
which stayed bf16. MFU keeps the bf16 peak as its denominator. torchao recommends compiling
float8 models (``--torch-compile``): the casts and scales fuse into the neighbouring kernels.

On a CPU, torchao's ``emulate=True`` runs the same numerics in plain arithmetic; rapidformer
refuses ``--precision fp8`` there (it would be slow and is only good for tests), and the tests
use :func:`convert_linears` with ``emulate=True`` directly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator

import torch
from torch import nn

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import Violation
from rapidformer.state import PlanStep, TrainState

EMULATE = False
"""True: convert with torchao's ``emulate=True`` and skip the GPU checks (float8 numerics in
plain arithmetic, on any device: for tests of how fp8 composes with the other switches)."""
HEAD_NAMES = ("lm_head", "head", "embed_out", "output", "classifier", "score")
"""Last components of module names that are output heads (kept in bf16)."""
FP8_CAPABILITY = (8, 9)


def eligible(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the linear layers to convert, names of those that stay bf16)."""
    convert: list[str] = []
    keep: list[str] = []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        head = name.rsplit(".", 1)[-1] in HEAD_NAMES or id(module.weight) in embeddings
        aligned = module.in_features % 16 == 0 and module.out_features % 16 == 0
        (convert if aligned and not head else keep).append(name)
    return convert, keep


def convert_linears(
    model: nn.Module, recipe: str, emulate: bool = False
) -> tuple[list[str], list[str]]:
    """Swap ``model``'s eligible linear layers for torchao's ``Float8Linear`` in place; returns
    (converted, kept) layer names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert, keep = eligible(model)
    chosen = set(convert)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in chosen
    )
    return convert, keep


def apply_fp8(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    if config.precision.precision != "fp8":
        return state
    recipe = config.precision.fp8_recipe
    converted: list[str] = []
    kept: list[str] = []
    for part in state.model_parts:
        done, left = convert_linears(part, recipe, emulate=EMULATE)
        converted += done
        kept += left
    shown = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    state.plan.append(
        PlanStep(
            "fp8",
            "torchao float8 training",
            f"{recipe} scaling{', emulated' if EMULATE else ''}; {len(converted)} linear layers "
            "to Float8Linear, "
            f"{len(kept)} kept in bf16 ({shown or 'none'}); bf16 autocast around them; MFU "
            "against the bf16 peak",
        )
    )
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """Where float8 training can run: a CUDA GPU with float8 matmuls and torchao; refused with
    tensor parallelism (torchao's float8 tensor-parallel styles are not wired here)."""
    precision = config.precision
    if precision.precision != "fp8":
        if precision.fp8_recipe != "tensorwise":
            yield Violation("--fp8-recipe", precision.fp8_recipe, "needs --precision fp8", "add it")
        return
    flag = "--precision"
    if EMULATE or not context.on_this_machine:
        pass  # tests: torchao's emulation runs anywhere; a dry run plans for other machines
    elif not torch.cuda.is_available():
        yield Violation(
            flag,
            "fp8",
            "needs a CUDA GPU with float8 matmuls (compute capability 8.9 or newer); this "
            "machine has no CUDA device",
            "use --precision bf16",
        )
    elif torch.cuda.get_device_capability() < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        yield Violation(
            flag,
            "fp8",
            f"needs compute capability 8.9 or newer for float8 matmuls; this GPU is "
            f"{major}.{minor}",
            "use --precision bf16",
        )
    if context.on_this_machine and importlib.util.find_spec("torchao") is None:
        yield Violation(
            flag, "fp8", "needs torchao (float8 training)", "pip install 'rapidformer[gpu]'"
        )
    if context.dims.tp > 1:
        yield Violation(
            flag,
            "fp8",
            f"cannot run with --tensor-model-parallel-size {context.dims.tp}: torchao's float8 "
            "tensor-parallel styles are not wired into rapidformer's tensor parallelism yet",
            "use --precision bf16 with tensor parallelism",
        )


FEATURE = Feature(
    "fp8",
    flags=("--precision", "--fp8-recipe"),
    rules=rules,
    switched_on=lambda config: "fp8" if config.precision.precision == "fp8" else None,
    refused_on={
        "deepspeed": "DeepSpeed's engine casts the model itself and has no float8 path here"
    },
)
