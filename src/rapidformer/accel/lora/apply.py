"""``--lora-rank``: train low-rank adapters on a frozen base (LoRA, DoRA, rsLoRA).

The step freezes every parameter, attaches an adapter to each target linear layer
(:mod:`.targets`, :mod:`.layer`) and unfreezes the adapters and the modules to save. Only
those reach the optimizer (it is built on the parameters that require gradients), so the base
has no gradients and no optimizer state; checkpoints write only them and record the base by a
fingerprint (:class:`rapidformer.state.FrozenBase`). It runs while the model is whole and
materialised, after fp8 (an adapter sits on a ``Float8Linear`` as on any linear) and before
compile (which traces the adapters with their block) and sharding (FSDP2 shards frozen and
trainable parameters of a block in one unit).

Fresh adapters start as LoRA does: A uniform, drawn from a generator seeded by ``--seed`` and
the layer's path (the same values on any layout and device), B zero, so the first loss is the
base model's. ``--lora-adapter DIR`` starts from an adapter rapidformer or PEFT saved instead.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import replace

import torch
from torch import nn

from rapidformer.accel.lora.layer import (
    adapted_layers,
    attach,
    base_weight,
    is_conv1d,
    tensor_parallel_style,
)
from rapidformer.accel.lora.peft_format import (
    DEFINING_KEYS,
    TASK_TYPES,
    AdapterSettings,
    peft_config,
)
from rapidformer.accel.lora.quantize import (
    NF4_BLOCK,
    is_nf4,
    nf4_fits,
    quantize_base,
    store_frozen,
)
from rapidformer.accel.lora.rules import late_weight_rules, lora_on
from rapidformer.accel.lora.settings import settings_of
from rapidformer.accel.lora.slot import Adapters
from rapidformer.accel.lora.start import (
    base_fingerprint,
    check_adapter_file,
    refuse_non_finite_base,
    start_adapters,
)
from rapidformer.accel.lora.targets import (
    is_output_head,
    modules_to_save,
    present_modules,
    target_paths,
)
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError
from rapidformer.log import log
from rapidformer.state import FrozenBase, PlanStep, TrainState


def apply_lora(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    if not lora_on(config):
        return state
    settings = settings_of(config)
    (model,) = state.model_parts  # pipeline parallelism is refused by the rules
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not config.planning.dry_run:  # a model's init would be its base
        refused = list(late_weight_rules(config))
        if refused:
            raise ConfigError(refused)
    if settings.modules_to_save:  # an adapter's
        saved = present_modules(model, settings.modules_to_save)
    else:
        saved = modules_to_save(model, config.adapters.lora_modules_to_save, config.training.task)
    if isinstance(settings.targets, str):
        targets = target_paths(model, settings.targets, saved)
    else:  # an adapter's list of paths (or names), matched as PEFT matches a list
        targets = target_paths(model, ",".join(settings.targets), saved)
    _check_tensor_parallel(model, targets, settings, config, mesh)
    heads = [t for t in targets if is_output_head(model, t)]
    if heads and config.memory.fused_lm_loss:
        raise ConfigError.single(
            "--lora-target-modules", config.adapters.lora_target_modules or settings.targets,
            f"puts an adapter on the output head ({', '.join(heads)}), which --fused-lm-loss "
            "computes from its weight alone: the adapter would never train",
            "leave the head out of the targets, or drop --fused-lm-loss",
        )  # fmt: skip
    if not on_meta:
        refuse_non_finite_base(model, settings.base or type(model).__name__)
    fingerprint = "" if on_meta else base_fingerprint(model, saved)
    if config.adapters.lora_adapter is not None:
        check_adapter_file(
            model, targets, settings.shape, config.adapters.lora_adapter, fingerprint
        )
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    modules = dict(model.named_modules())
    for path in targets:
        attach(modules[path], settings.shape)
    for path in saved:
        modules[path].requires_grad_(True)
    stored = _store_base(model, config, mesh)
    if not on_meta:  # else once materialised (a model's own init knows only its base)
        start_adapters(model, config)
    if config.graph.torch_compile:
        _blocks_see_gradient_inputs(model)
    trainable = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    layers = adapted_layers(model).values()
    written = replace(
        settings,
        targets=tuple(targets),
        modules_to_save=tuple(saved),
        task_type=TASK_TYPES.get(config.training.task or ""),
        fan_in_fan_out=any(is_conv1d(layer) for layer in layers),
    )
    state.frozen_base = FrozenBase(
        trainable=trainable,
        fingerprint=fingerprint,
        source=settings.base or type(model).__name__,
        additions=Adapters(config),
        adapter_config=peft_config(written),
        defining_keys=DEFINING_KEYS,
        model_config=_hugging_face_config(model),
    )
    state.plan.append(_plan_step(model, settings, targets, saved, stored))
    return state


def _check_tensor_parallel(
    model: nn.Module,
    targets: list[str],
    settings: AdapterSettings,
    config: RapidformerConfig,
    mesh: ParallelMesh,
) -> None:
    """Adapters follow column- and row-parallel layers, LoRA and rsLoRA: a layout the model
    arrives in (transformers' tp_plan, applied as the Finetuner loads it), or one its own
    ``tp_plan`` gives it after the adapters attach (the built-in models)."""
    if mesh.dims.tp == 1:
        return
    modules = dict(model.named_modules())
    styles = {path: tensor_parallel_style(base_weight(modules[path])) for path in targets}
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and all(style is None for style in styles.values()):
        styles = {path: _planned_style(path, plan) for path in targets}
    whole = [path for path, style in styles.items() if style is None]
    other = [path for path, style in styles.items() if style == "other"]
    problem = ""
    if whole and not isinstance(plan, dict):
        problem = f"{whole[0]} (and {len(whole) - 1} more) is not sharded"
    elif other:
        problem = f"{other[0]} is sharded neither column- nor row-parallel"
    elif settings.shape.variant == "dora":
        problem = "DoRA's weight norms are not computed over tensor-parallel shards yet"
    elif config.parallel.sequence_parallel:
        problem = (
            "with --sequence-parallel a row-parallel layer gives a shard of the sequence, and "
            "an adapter's term is computed for the whole of it"
        )
    if problem:
        raise ConfigError.single(
            "--tensor-model-parallel-size", mesh.dims.tp,
            f"adapters cannot run here: {problem}",
            "use LoRA or rsLoRA on column- and row-parallel layers (without "
            "--sequence-parallel), or drop --tensor-model-parallel-size (data parallelism and "
            "ZeRO run every variant)",
        )  # fmt: skip


def _planned_style(path: str, plan: dict[str, str]) -> str | None:
    """What a built-in ``tp_plan`` will make of the layer at ``path``: colwise, rowwise,
    ``other`` (the vocabulary-parallel head), or None (it stays whole on every rank)."""
    kinds = {kind for pattern, kind in plan.items() if fnmatch.fnmatchcase(path, pattern)}
    for kind in ("colwise", "rowwise"):
        if kind in kinds:
            return kind
    return "other" if kinds & {"vocab_logits", "vocab_parallel"} else None


def _hugging_face_config(model: nn.Module) -> dict[str, object]:
    config = getattr(model, "config", None)
    as_json = getattr(config, "to_json_string", None)
    return json.loads(as_json()) if callable(as_json) else {}


def _store_base(model: nn.Module, config: RapidformerConfig, mesh: ParallelMesh) -> str:
    """How the frozen base is stored (before the adapters' values are set: DoRA's magnitude
    starts at the norms of the weights its forward reads); returns what the plan says of it.
    On the meta device (a dry run) NF4 quantises too: its tensor has the same parts, so the
    dry run counts the bytes the run holds."""
    if config.adapters.quantize_base is None:
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision.precision)
        if autocast is not None:
            # Frozen linear weights in the autocast dtype: the matmuls cast them so anyway.
            store_frozen(model, autocast, linear_only=True)
        return ""
    sharded = config.memory.sharding in ("zero2", "zero3")
    shards = mesh.dims.dp if sharded else 1
    _refuse_nf4_of_nothing(adapted_layers(model), shards)
    quantised, kept = quantize_base(adapted_layers(model), shards)
    store_frozen(model, torch.bfloat16, linear_only=False)
    # DDP broadcasts rank 0's parameters when it wraps the model, through a flat buffer of
    # each tensor's reported dtype and size: an NF4 weight (uint8 codes behind a bf16 face)
    # would arrive damaged. Every rank quantised the same weights; DDP leaves them alone.
    model._ddp_params_and_buffers_to_ignore = [  # type: ignore[assignment]
        name for name, p in model.named_parameters() if is_nf4(p)
    ]
    listed = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return f"; NF4 (torchao) for {len(quantised)} adapted layers' weights" + (
        f", bf16 for {len(kept)} whose size is no multiple of {NF4_BLOCK}"
        f"{f' x {mesh.dims.dp} ranks' if sharded else ''} ({listed})"
        if kept else ""
    )  # fmt: skip


def _refuse_nf4_of_nothing(layers: dict[str, nn.Module], shards: int) -> None:
    """QLoRA that would store no weight in NF4 is refused (it would run as plain LoRA under
    its name); one that stores only some says how many stay in bf16."""
    kept = [path for path, layer in layers.items() if not nf4_fits(layer, shards)]
    block = f"{NF4_BLOCK}" + (f" x {shards} ranks" if shards > 1 else "")
    if kept and len(kept) == len(layers):
        sizes = sorted({tuple(base_weight(layer).shape) for layer in layers.values()})
        raise ConfigError.single(
            "--quantize-base", "nf4",
            f"none of the {len(layers)} adapted layers' weights can be stored in NF4: a weight "
            f"needs a multiple of {block} values, and these are "
            f"{', '.join('x'.join(map(str, s)) for s in sizes[:4])} (GPT-2's Conv1D never)",
            "drop --quantize-base (--precision bf16 stores the frozen base in bf16), or adapt "
            f"layers whose weights hold a multiple of {block} values (e.g. 128 x 128)",
        )  # fmt: skip
    if kept:
        log.warning(
            "--quantize-base nf4: %d of the %d adapted layers keep their weights in bf16 "
            "(their size is no multiple of %s values)", len(kept), len(layers), block,
        )  # fmt: skip


def _blocks_see_gradient_inputs(model: nn.Module) -> None:
    """Frozen embeddings give the first block an input that needs no gradient, and every later
    block one that does: compiled per block, that is two graphs per shape. Their outputs are
    marked as needing one (one more matmul in the first block's backward), so every block
    shares one graph."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and not module.weight.requires_grad:
            module.register_forward_hook(_needs_gradient)


def _needs_gradient(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True) if torch.is_grad_enabled() else output


def _plan_step(
    model: nn.Module, settings: AdapterSettings, targets: list[str], saved: list[str], stored: str
) -> PlanStep:
    shape = settings.shape
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    names = sorted({t.rsplit(".", 1)[-1] for t in targets})
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                     if not p.requires_grad and not is_nf4(p)})  # fmt: skip
    scale = f"alpha {shape.alpha:g} / {'sqrt(rank)' if shape.variant == 'rslora' else 'rank'}"
    return PlanStep(
        "adapters",
        f"{shape.variant} (rapidformer's adapter layer; PEFT's format on disk)",
        f"rank {shape.rank}, {scale} = {shape.scaling:g}, dropout {shape.dropout:g}; "
        f"{len(targets)} layers adapted ({', '.join(names)}); trained in full: "
        f"{', '.join(saved) or 'none'}; trainable {trainable:,} of {total:,} parameters "
        f"({100 * trainable / max(total, 1):.2f}%), frozen {total - trainable:,}; base stored "
        f"as {', '.join(dtypes) or '-'}{stored}",
    )
