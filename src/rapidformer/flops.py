"""Training FLOPs per token from a model's shape: what MFU is measured against.

A training step costs, per token, 6 FLOPs for every weight of a matrix multiplication (2 in the
forward, 4 in the backward) and, per layer, 12 x sequence length x attention width for the
attention scores and their weighted sum (forward 4 s d, backward twice that; not halved for a
causal mask, as Megatron, PaLM and torchtitan count). Embedding lookups are no matrix products;
the LM head is one (also when tied to the embeddings). An MoE layer counts its router and the
``top-k`` experts a token is sent to, not the others. These are *model* FLOPs; activation
checkpointing runs each block's forward once more, which the hardware pays for:
``hardware = model + 2 x block weights + 4 s d per layer``.

:func:`flop_shape` reads the shape from rapidformer's built-in GPT/BERT configs and from
Hugging Face configs (decoder and encoder families by their standard fields, GPT-2's
``n_*`` names through the config's attribute map, Mixtral/Qwen-MoE experts, T5/BART with their
decoders' cross-attention); :func:`flops_per_token` turns it into numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapidformer.models.bert import BertConfig
from rapidformer.models.gpt import GPTConfig

GATED_MLP_ACTIVATIONS = ("silu", "swish", "swiglu", "geglu", "gated-gelu", "gated-silu")


@dataclass(frozen=True)
class FlopShape:
    """The matrix shapes one token passes through."""

    layers: int
    hidden: int
    attention_width: int
    """Width of the queries and of the attention output (heads x head_dim)."""
    kv_width: int
    """Width of the keys and the values (kv_heads x head_dim; = attention width without GQA)."""
    ffn: int
    """Hidden width of each FFN a token passes through (an expert's, in an MoE layer)."""
    ffn_matrices: int
    """2 (up, down) or 3 (gated: gate, up, down)."""
    vocab: int
    experts_per_token: int = 1
    """FFNs a token passes through per layer (MoE: top-k; dense: 1)."""
    router_experts: int = 0
    """Experts the router scores (its matrix is hidden x experts); 0: no router."""
    moe_layers: int = 0
    """How many of ``layers`` are MoE layers (the rest are dense with ``dense_ffn``)."""
    dense_ffn: int = 0
    """FFN width of the dense layers of a partly MoE model."""
    shared_ffn: int = 0
    """Width of an always-active shared expert in MoE layers (Qwen2-MoE, DeepSeek)."""
    cross_attention_layers: int = 0
    """Decoder layers of an encoder-decoder, which also attend to the encoder's output."""
    extra_weights: int = 0
    """Other matrix weights per token (BERT's pooler and MLM transform)."""

    def block_weights(self) -> int:
        """Matrix weights a token passes through in the transformer blocks."""
        attention = 2 * self.hidden * (self.attention_width + self.kv_width)
        gated = self.ffn_matrices * self.hidden
        dense_layers = self.layers - self.moe_layers
        moe = self.experts_per_token * gated * self.ffn + self.hidden * self.router_experts
        moe += gated * self.shared_ffn
        dense = gated * (self.dense_ffn if self.moe_layers else self.ffn)
        cross = self.cross_attention_layers * attention
        return self.layers * attention + dense_layers * dense + self.moe_layers * moe + cross

    def matrix_weights(self) -> int:
        """All matrix weights a token passes through: the blocks, the LM head, the rest."""
        return self.block_weights() + self.vocab * self.hidden + self.extra_weights


@dataclass(frozen=True)
class FlopsPerToken:
    model: float
    """What the model needs (forward + backward), the MFU numerator."""
    hardware: float
    """What the device computes: with activation checkpointing, the recomputed forward too."""


def flops_per_token(shape: FlopShape, seq_length: int, recompute: bool = False) -> FlopsPerToken:
    """Training FLOPs per token at sequence length ``seq_length`` (see the module docstring)."""
    attention_layers = shape.layers + shape.cross_attention_layers
    scores = 4 * seq_length * shape.attention_width * attention_layers  # forward
    model = 6 * shape.matrix_weights() + 3 * scores
    again = 2 * shape.block_weights() + scores if recompute else 0
    return FlopsPerToken(model=float(model), hardware=float(model + again))


def flop_shape(model: Any) -> FlopShape | None:
    """The shape of ``model`` (rapidformer's GPT/BERT, a Hugging Face model, or either's
    config); None for a model of unknown shape."""
    config = getattr(model, "config", model)

    if isinstance(config, GPTConfig | BertConfig):
        return _builtin(config)
    if hasattr(config, "model_type") and hasattr(config, "to_dict"):
        return _hugging_face(config)
    return None


def _builtin(config: Any) -> FlopShape:

    hidden, ffn, moe = config.hidden_size, config.ffn_size, config.moe
    bert = isinstance(config, BertConfig)
    return FlopShape(
        layers=config.num_layers,
        hidden=hidden,
        attention_width=hidden,
        kv_width=hidden,
        ffn=(moe.ffn_hidden_size or ffn) if moe else ffn,
        ffn_matrices=2,
        vocab=config.vocab_size,
        experts_per_token=moe.topk if moe else 1,
        router_experts=moe.num_experts if moe else 0,
        moe_layers=len(moe.layers) if moe else 0,
        dense_ffn=ffn,
        # BERT: the pooler and the MLM head's transform (h x h each) before the LM head.
        extra_weights=2 * hidden * hidden if bert else 0,
    )


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _hugging_face(config: Any) -> FlopShape | None:
    hidden = _first(config, "hidden_size", "d_model", "n_embd")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    if not (hidden and heads and layers):
        return None
    head_dim = _first(config, "head_dim", "d_kv", default=hidden // heads)
    kv_heads = _first(config, "num_key_value_heads", default=heads)
    activation = str(_first(config, "hidden_act", "feed_forward_proj", "activation_function"))
    gated = activation.lower() in GATED_MLP_ACTIVATIONS or activation.startswith("gated")
    ffn = _first(
        config, "intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", default=4 * hidden
    )
    decoder_layers = 0
    if getattr(config, "is_encoder_decoder", False):
        decoder_layers = _first(config, "num_decoder_layers", "decoder_layers", default=layers)
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    top_k = _first(config, "num_experts_per_tok", default=1)
    expert_ffn = _first(config, "moe_intermediate_size", default=ffn)
    shared = _first(config, "shared_expert_intermediate_size", default=0)
    return FlopShape(
        layers=layers + decoder_layers,
        hidden=hidden,
        attention_width=heads * head_dim,
        kv_width=kv_heads * head_dim,
        ffn=expert_ffn if experts else ffn,
        ffn_matrices=3 if gated else 2,
        vocab=config.vocab_size,
        experts_per_token=top_k if experts else 1,
        router_experts=experts,
        moe_layers=layers if experts else 0,
        dense_ffn=ffn,
        shared_ffn=shared if experts else 0,
        cross_attention_layers=decoder_layers,
    )


def linear_weights(model: Any) -> int:
    """Weights of the model's ``nn.Linear`` layers, each counted where it is applied (a tied
    LM head too): 6 x this is the FLOPs per token of a model of unknown shape, without the
    attention term."""
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class MfuMeter:
    """Turns measured tokens/s into achieved TFLOP/s per device and MFU."""

    per_token: FlopsPerToken
    peak_tflops: float | None
    devices: int
    recompute: bool
    basis: str
    """How the FLOPs per token were counted (for the plan)."""

    def fields(self, tokens_per_s: float) -> dict[str, float]:
        """``tflops`` (model FLOPs per device), ``hardware_tflops`` (with the recomputed
        forward, under activation checkpointing) and ``mfu`` (with a known peak)."""
        per_device = tokens_per_s / max(self.devices, 1)
        tflops = per_device * self.per_token.model / 1e12
        fields = {"tflops": tflops}
        if self.recompute:
            fields["hardware_tflops"] = per_device * self.per_token.hardware / 1e12
        if self.peak_tflops:
            fields["mfu"] = tflops / self.peak_tflops
        return fields


def mfu_meter(
    model: Any, seq_length: int, recompute: bool, peak_tflops: float | None, devices: int
) -> MfuMeter:
    """The meter for ``model`` (its shape when known, else its linear weights)."""
    shape = flop_shape(model)
    if shape is not None:
        per_token = flops_per_token(shape, seq_length, recompute)
        basis = f"6 x {shape.matrix_weights():,} matrix weights + attention at length {seq_length}"
    else:
        weights = linear_weights(model)
        blocks = 2 * weights if recompute else 0
        per_token = FlopsPerToken(model=6.0 * weights, hardware=6.0 * weights + blocks)
        basis = f"6 x {weights:,} linear weights (shape unknown: no attention term)"
    return MfuMeter(per_token, peak_tflops, devices, recompute, basis)
