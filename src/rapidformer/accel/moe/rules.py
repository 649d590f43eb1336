"""What the MoE flags mean and which combinations are refused (checked before any process
group or model exists, with the rest of the configuration)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.schema import MoEConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.errors import Violation
from rapidformer.models.moe import MoESpec


def moe_enabled(config: RapidformerConfig) -> bool:
    experts = config.moe.num_experts
    return experts is not None and experts > 1


def moe_layer_indices(freq: str, num_layers: int) -> tuple[int, ...]:
    """The layers ``--moe-layer-freq`` makes MoE: ``k`` = every k-th from layer 0, or a
    pattern of one 0/1 per layer (``[0,1,1,1]`` or ``0,1,1,1``)."""
    text = freq.strip().strip("[]").replace(" ", "")
    if "," in text or (len(text) > 1 and set(text) <= {"0", "1"}):
        bits = [b for b in text.split(",")] if "," in text else list(text)
        if len(bits) != num_layers or not set(bits) <= {"0", "1"}:
            raise ValueError(
                f"pattern has {len(bits)} entries of 0/1, the model has {num_layers} layers"
            )
        return tuple(i for i, b in enumerate(bits) if b == "1")
    every = int(text)
    if every < 1:
        raise ValueError("a frequency must be at least 1")
    return tuple(range(0, num_layers, every))


def moe_spec(config: RapidformerConfig, num_layers: int) -> MoESpec:
    moe = config.moe
    assert moe.num_experts is not None
    return MoESpec(
        num_experts=moe.num_experts,
        layers=moe_layer_indices(moe.moe_layer_freq, num_layers),
        topk=moe.moe_router_topk,
        ffn_hidden_size=moe.moe_ffn_hidden_size,
        capacity_factor=moe.moe_expert_capacity_factor,
        drop_policy=moe.moe_token_drop_policy,
        balancing=moe.moe_router_load_balancing_type,
        aux_loss_coeff=moe.moe_aux_loss_coeff,
        z_loss_coeff=moe.moe_z_loss_coeff,
        score=moe.moe_router_score_function,
    )


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    moe, dims = config.moe, context.dims
    experts = moe.num_experts
    ep = moe.expert_model_parallel_size
    enabled = experts is not None and experts > 1
    if not enabled:
        changed = [
            (f.name, getattr(moe, f.name))
            for f in dataclasses.fields(moe)
            if f.name != "num_experts" and getattr(moe, f.name) != f.default
        ]
        for name, value in changed:
            flag = "--" + name.replace("_", "-")
            yield Violation(
                flag,
                value,
                "has no effect without --num-experts > 1",
                f"add --num-experts N or remove {flag}",
            )
        return
    assert experts is not None
    if not 1 <= moe.moe_router_topk <= experts:
        yield Violation(
            "--moe-router-topk",
            moe.moe_router_topk,
            f"must lie in [1, --num-experts {experts}]",
            f"use --moe-router-topk {min(2, experts)}",
        )
    if experts % ep:
        yield Violation(
            "--expert-model-parallel-size",
            ep,
            f"must divide --num-experts {experts}",
            "choose a divisor of the expert count",
        )
    if dims.dp >= 1 and dims.dp % ep:
        yield Violation(
            "--expert-model-parallel-size",
            ep,
            f"must divide the data-parallel size {dims.dp} (world {dims.world_size} / "
            f"(tp {dims.tp} x pp {dims.pp}))",
            "choose a divisor of the data-parallel size, or launch more ranks",
        )
    factor = moe.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        yield Violation(
            "--moe-expert-capacity-factor",
            factor,
            "must be positive",
            "e.g. 1.0, or leave it unset for dropless routing",
        )
    if factor is None and moe.moe_token_drop_policy != "probs":
        yield Violation(
            "--moe-token-drop-policy",
            moe.moe_token_drop_policy,
            "has no effect without --moe-expert-capacity-factor (dropless)",
            "set a capacity factor or remove the flag",
        )
    if moe.moe_aux_loss_coeff < 0 or (moe.moe_z_loss_coeff or 0) < 0:
        yield Violation(
            "--moe-aux-loss-coeff",
            moe.moe_aux_loss_coeff,
            "loss coefficients must be >= 0",
            "e.g. 1e-2",
        )
    if (
        moe.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "global_aux_loss")
        and moe.moe_aux_loss_coeff != 1e-2
    ):
        yield Violation(
            "--moe-aux-loss-coeff",
            moe.moe_aux_loss_coeff,
            "has no effect with --moe-router-load-balancing-type "
            + moe.moe_router_load_balancing_type,
            "use aux_loss, seq_aux_loss or global_aux_loss, or remove --moe-aux-loss-coeff",
        )
    if moe.moe_router_load_balancing_type == "global_aux_loss" and dims.pp > 1:
        yield Violation(
            "--moe-router-load-balancing-type",
            "global_aux_loss",
            f"counts the routing of the whole step before its first backward, which a "
            f"pipeline schedule (--pipeline-model-parallel-size {dims.pp}) interleaves with "
            "the forwards",
            "use aux_loss or seq_aux_loss with pipeline parallelism (both equal on every "
            "layout), or drop the pipeline",
        )
    if (
        moe.moe_router_load_balancing_type != "expert_bias"
        and moe.moe_router_bias_update_rate != 1e-3
    ):
        yield Violation(
            "--moe-router-bias-update-rate",
            moe.moe_router_bias_update_rate,
            "only moves the expert bias of --moe-router-load-balancing-type expert_bias",
            "add that balancing type or remove the flag",
        )
    try:
        moe_layer_indices(moe.moe_layer_freq, max(config.model.num_layers or 1, 1))
    except ValueError as error:
        if config.model.num_layers is not None or "," not in moe.moe_layer_freq:
            yield Violation(
                "--moe-layer-freq",
                moe.moe_layer_freq,
                str(error),
                "use 1 (every layer), k (every k-th) or one 0/1 per layer, e.g. [0,1,0,1]",
            )
    if moe.moe_use_upcycling and config.checkpoint.load is None:
        yield Violation(
            "--moe-use-upcycling",
            True,
            "needs the dense checkpoint to start from",
            "pass --load DIR of a dense run's checkpoint (or compose() a materialised dense "
            "built-in model, which is upcycled without the flag)",
        )
    if dims.tp > 1 and config.parallel.sequence_parallel:
        yield Violation(
            "--num-experts",
            experts,
            "cannot run with --sequence-parallel: MoE layers take the whole sequence "
            "(experts are replicated over tp)",
            "drop --sequence-parallel",
        )


FEATURE = Feature(
    "mixture of experts",
    flags=tuple("--" + f.name.replace("_", "-") for f in dataclasses.fields(MoEConfig)),
    rules=rules,
    switched_on=lambda config: config.moe.num_experts if moe_enabled(config) else None,
    refused_on={"deepspeed": "rapidformer's MoE layers are not run by the DeepSpeed engine"},
)
