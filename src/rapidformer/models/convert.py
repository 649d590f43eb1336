"""Conversion between the built-in models and Hugging Face ``transformers``.

``gpt_from_hf`` / ``gpt_to_hf`` map state dicts between :class:`GPTModel` and
``transformers.GPT2LMHeadModel``; ``bert_from_hf`` / ``bert_to_hf`` between :class:`BertModel`
and ``transformers.BertForPreTraining``. They only rename, split and transpose tensors:

* GPT-2 stores its projections as ``Conv1D`` with weights ``[in, out]``; ours are ``nn.Linear``
  with ``[out, in]``, so every projection weight is transposed;
* GPT-2 fuses Q, K and V into one ``c_attn`` (``[hidden, 3 * hidden]``, Q then K then V along
  the output features); we keep three projections (see :mod:`rapidformer.models.layers` for
  why), so it is split on the way in and concatenated on the way out;
* tied weights (LM head / MLM decoder = token embedding, BERT's decoder bias =
  ``cls.predictions.bias``) appear under every name the target model's ``state_dict`` has, as
  the same tensor, so ``load_state_dict(strict=True)`` accepts the result.

``export_hugging_face`` writes a directory that ``transformers.AutoModelFor*.from_pretrained``
loads; ``load_hugging_face`` reads such a directory back into a built-in model. Both need
``transformers`` (imported lazily; the state-dict functions do not).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rapidformer.models.bert import BertConfig, BertModel
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.safe_load import hugging_face_weights

if TYPE_CHECKING:
    import transformers

StateDict = dict[str, torch.Tensor]

# Per-layer (ours, GPT-2's, weight stored as Conv1D [in, out]) names; c_attn is handled apart.
_GPT_LAYER = [
    ("attention_norm.weight", "ln_1.weight", False),
    ("attention_norm.bias", "ln_1.bias", False),
    ("attention.out_proj.weight", "attn.c_proj.weight", True),
    ("attention.out_proj.bias", "attn.c_proj.bias", False),
    ("ffn_norm.weight", "ln_2.weight", False),
    ("ffn_norm.bias", "ln_2.bias", False),
    ("ffn.fc1.weight", "mlp.c_fc.weight", True),
    ("ffn.fc1.bias", "mlp.c_fc.bias", False),
    ("ffn.fc2.weight", "mlp.c_proj.weight", True),
    ("ffn.fc2.bias", "mlp.c_proj.bias", False),
]
_GPT_TOP = [
    ("token_embeddings.weight", "transformer.wte.weight"),
    ("position_embeddings.weight", "transformer.wpe.weight"),
    ("final_norm.weight", "transformer.ln_f.weight"),
    ("final_norm.bias", "transformer.ln_f.bias"),
]
# Buffers older GPT-2 checkpoints carry (the causal mask); they hold no weights.
_GPT_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")

_BERT_LAYER = [
    ("attention.q_proj", "attention.self.query"),
    ("attention.k_proj", "attention.self.key"),
    ("attention.v_proj", "attention.self.value"),
    ("attention.out_proj", "attention.output.dense"),
    ("attention_norm", "attention.output.LayerNorm"),
    ("ffn.fc1", "intermediate.dense"),
    ("ffn.fc2", "output.dense"),
    ("ffn_norm", "output.LayerNorm"),
]
_BERT_TOP = [
    ("token_embeddings", "bert.embeddings.word_embeddings"),
    ("position_embeddings", "bert.embeddings.position_embeddings"),
    ("token_type_embeddings", "bert.embeddings.token_type_embeddings"),
    ("embedding_norm", "bert.embeddings.LayerNorm"),
    ("pooler", "bert.pooler.dense"),
    ("mlm_transform", "cls.predictions.transform.dense"),
    ("mlm_norm", "cls.predictions.transform.LayerNorm"),
    ("sop_head", "cls.seq_relationship"),
]
_BERT_IGNORED = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


class _Source:
    """Hands out the tensors of a foreign state dict by name and reports what was left over."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str) -> None:
        self.state = state
        self.what = what
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def take(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise KeyError(f"{self.what} state dict has no {key!r}")
        self.used.add(key)
        return self.state[key].detach()

    def finish(self, ignored: Any = lambda key: False) -> None:
        extra = sorted(k for k in self.state if k not in self.used and not ignored(k))
        if extra:
            raise ValueError(f"unexpected keys in the {self.what} state dict: {extra}")


def _same_tensor_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b.to(a.device)))


def gpt_from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: GPTConfig) -> StateDict:
    """A :class:`GPTModel` state dict from a ``GPT2LMHeadModel`` (or bare ``GPT2Model``,
    whose keys lack the ``transformer.`` prefix) state dict."""
    state = {
        key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}": value
        for key, value in hf_state_dict.items()
    }
    src = _Source(state, "GPT-2")
    out: StateDict = {ours: src.take(theirs) for ours, theirs in _GPT_TOP}
    hidden = config.hidden_size
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        weight = src.take(hf + "attn.c_attn.weight")  # [hidden, 3 * hidden], Conv1D layout
        bias = src.take(hf + "attn.c_attn.bias")
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            part = slice(j * hidden, (j + 1) * hidden)
            out[f"{ours}attention.{name}.weight"] = weight[:, part].t().contiguous()
            out[f"{ours}attention.{name}.bias"] = bias[part].contiguous()
        for our_name, hf_name, conv1d in _GPT_LAYER:
            tensor = src.take(hf + hf_name)
            out[ours + our_name] = tensor.t().contiguous() if conv1d else tensor
    embedding = out["token_embeddings.weight"]
    if config.tie_word_embeddings:
        if "lm_head.weight" in src and not _same_tensor_values(
            embedding, src.take("lm_head.weight")
        ):
            raise ValueError(
                "the GPT-2 lm_head differs from its token embedding, but the config ties them: "
                "use GPTConfig(tie_word_embeddings=False)"
            )
        out["lm_head.weight"] = embedding
    else:
        out["lm_head.weight"] = src.take("lm_head.weight")
    src.finish(lambda key: key.endswith(_GPT_IGNORED_SUFFIXES))
    return out


def gpt_to_hf(model: GPTModel) -> StateDict:
    """A ``transformers.GPT2LMHeadModel`` state dict from a :class:`GPTModel`."""
    src = _Source(model.state_dict(), "GPTModel")
    out: StateDict = {theirs: src.take(ours) for ours, theirs in _GPT_TOP}
    for i in range(model.config.num_layers):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        names = [f"{ours}attention.{n}_proj" for n in "qkv"]
        out[hf + "attn.c_attn.weight"] = torch.cat([src.take(n + ".weight") for n in names]).t()
        out[hf + "attn.c_attn.bias"] = torch.cat([src.take(n + ".bias") for n in names])
        for our_name, hf_name, conv1d in _GPT_LAYER:
            tensor = src.take(ours + our_name)
            out[hf + hf_name] = tensor.t().contiguous() if conv1d else tensor
    out["lm_head.weight"] = src.take("lm_head.weight")
    for key, value in out.items():
        out[key] = value.contiguous()
    src.finish()
    return out


def _bert_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(our module path, BertForPreTraining's) for every module with a weight."""
    pairs = list(_BERT_TOP)
    for i in range(num_layers):
        prefix = f"bert.encoder.layer.{i}."
        pairs += [(f"blocks.{i}.{ours}", prefix + theirs) for ours, theirs in _BERT_LAYER]
    return pairs


def bert_from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: BertConfig) -> StateDict:
    """A :class:`BertModel` state dict from a ``transformers.BertForPreTraining`` state dict."""
    src = _Source(hf_state_dict, "BertForPreTraining")
    out: StateDict = {}
    for ours, theirs in _bert_pairs(config.num_layers):
        for leaf in ("weight", "bias"):
            if ours.endswith("embeddings") and leaf == "bias":
                continue
            out[f"{ours}.{leaf}"] = src.take(f"{theirs}.{leaf}")
    embedding = out["token_embeddings.weight"]
    if "cls.predictions.decoder.weight" in src and not _same_tensor_values(
        embedding, src.take("cls.predictions.decoder.weight")
    ):
        raise ValueError("the MLM decoder differs from the word embedding; BertModel ties them")
    out["lm_head.weight"] = embedding
    # transformers ties decoder.bias to cls.predictions.bias; older checkpoints have only one.
    bias_keys = [k for k in ("cls.predictions.bias", "cls.predictions.decoder.bias") if k in src]
    if not bias_keys:
        raise KeyError("BertForPreTraining state dict has no 'cls.predictions.bias'")
    out["lm_head.bias"] = src.take(bias_keys[0])
    for key in bias_keys[1:]:
        if not _same_tensor_values(out["lm_head.bias"], src.take(key)):
            raise ValueError(f"{key} differs from {bias_keys[0]}")
    src.finish(lambda key: key in _BERT_IGNORED)
    return out


def bert_to_hf(model: BertModel) -> StateDict:
    """A ``transformers.BertForPreTraining`` state dict from a :class:`BertModel`."""
    src = _Source(model.state_dict(), "BertModel")
    out: StateDict = {}
    for ours, theirs in _bert_pairs(model.config.num_layers):
        for leaf in ("weight", "bias"):
            if ours.endswith("embeddings") and leaf == "bias":
                continue
            out[f"{theirs}.{leaf}"] = src.take(f"{ours}.{leaf}")
    out["cls.predictions.decoder.weight"] = src.take("lm_head.weight")
    bias = src.take("lm_head.bias")
    out["cls.predictions.bias"] = bias
    out["cls.predictions.decoder.bias"] = bias
    src.finish()
    return out


def hf_config_for(model: GPTModel | BertModel) -> transformers.GPT2Config | transformers.BertConfig:
    """The ``transformers`` config of the equivalent Hugging Face model."""
    import transformers

    if isinstance(model, GPTModel):
        g = model.config
        # GPT-2's <|endoftext|> id only exists in a GPT-2-sized vocabulary.
        eot = 50256 if g.vocab_size > 50256 else None
        return transformers.GPT2Config(
            **_theirs(g, GPT2_NAMES),
            n_inner=g.ffn_size,
            activation_function="gelu_new",
            resid_pdrop=g.dropout,
            embd_pdrop=g.dropout,
            attn_pdrop=g.dropout,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            bos_token_id=eot,
            eos_token_id=eot,
            architectures=["GPT2LMHeadModel"],
        )
    if isinstance(model, BertModel):
        b = model.config
        return transformers.BertConfig(
            **_theirs(b, BERT_NAMES),
            intermediate_size=b.ffn_size,
            hidden_act="gelu",
            hidden_dropout_prob=b.dropout,
            attention_probs_dropout_prob=b.dropout,
            tie_word_embeddings=True,
            architectures=["BertForPreTraining"],
        )
    raise TypeError(f"expected a GPTModel or BertModel, got {type(model).__name__}")


def export_hugging_face(
    model: GPTModel | BertModel, out_dir: str | Path, tokenizer: Any = None
) -> Path:
    """Save ``model`` as a Hugging Face ``GPT2LMHeadModel`` / ``BertForPreTraining`` directory
    (``config.json`` + safetensors weights), plus ``tokenizer`` when one is given (anything with
    ``save_pretrained``, e.g. a ``transformers`` tokenizer; its special token ids go into the
    config). Weights are loaded strictly, so a naming mismatch fails here, not when loading."""
    import transformers

    config = hf_config_for(model)
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise TypeError("tokenizer must have save_pretrained (a transformers tokenizer)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name, None) is not None:
                setattr(config, name, getattr(tokenizer, name))
    hf_class: Any
    if isinstance(model, GPTModel):
        hf_class, state = transformers.GPT2LMHeadModel, gpt_to_hf(model)
    else:
        hf_class, state = transformers.BertForPreTraining, bert_to_hf(model)
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):  # HF's random init must not move the caller's RNG
        hf_model = hf_class(config).to(dtype)
    hf_model.load_state_dict(state, strict=True)
    out = Path(out_dir)
    hf_model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _ffn_or_default(size: int | None, hidden: int) -> int | None:
    """None (our default) when the FFN has the default 4x width, so configs round-trip equal."""
    return None if size is None or size == 4 * hidden else int(size)


_SIZE = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
)
GPT2_NAMES = {
    **dict(zip(_SIZE, ("vocab_size", "n_layer", "n_embd", "n_head", "n_positions"), strict=True)),
    "layernorm_epsilon": "layer_norm_epsilon",
    "tie_word_embeddings": "tie_word_embeddings",
}
"""GPTConfig's fields -> GPT2Config's names for them (the FFN width and dropout aside)."""
BERT_NAMES = {
    **dict(zip(_SIZE, (*_SIZE[:1], "num_hidden_layers", *_SIZE[2:]), strict=True)),
    "type_vocab_size": "type_vocab_size",
    "layernorm_epsilon": "layer_norm_eps",
}
"""BertConfig's fields -> transformers' BertConfig names for them."""


def _theirs(config: Any, names: dict[str, str]) -> dict[str, Any]:
    return {theirs: getattr(config, ours) for ours, theirs in names.items()}


def _ours(hf: Any, names: dict[str, str], problems: list[str], model: str) -> dict[str, Any]:
    """Our config's fields from a Hugging Face config, or ValueError naming what ``model``
    does not compute."""
    if problems:
        raise ValueError(f"{model} cannot compute this config: " + "; ".join(problems))
    return {ours: getattr(hf, theirs) for ours, theirs in names.items()}


def _gpt_config_from_hf(hf: Any) -> GPTConfig:
    problems = []
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={hf.activation_function!r} (GELU-tanh only)")
    if not hf.scale_attn_weights or hf.scale_attn_by_inverse_layer_idx:
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if getattr(hf, "add_cross_attention", False):
        problems.append("cross-attention")
    return GPTConfig(
        **_ours(hf, GPT2_NAMES, problems, "GPTModel"),
        ffn_hidden_size=_ffn_or_default(hf.n_inner, hf.n_embd),
        dropout=float(hf.resid_pdrop),
    )


def _bert_config_from_hf(hf: Any) -> BertConfig:
    problems = []
    if hf.hidden_act != "gelu":
        problems.append(f"hidden_act={hf.hidden_act!r} (erf GELU only)")
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type={hf.position_embedding_type!r}")
    if getattr(hf, "is_decoder", False):
        problems.append("is_decoder=True")
    return BertConfig(
        **_ours(hf, BERT_NAMES, problems, "BertModel"),
        ffn_hidden_size=_ffn_or_default(hf.intermediate_size, hf.hidden_size),
        dropout=float(hf.hidden_dropout_prob),
    )


def load_hugging_face(
    directory: str | Path, device: str | torch.device = "cpu"
) -> GPTModel | BertModel:
    """A built-in model from a saved ``GPT2LMHeadModel`` or ``BertForPreTraining`` directory
    (``model_type`` "gpt2" or "bert" in its ``config.json``)."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(directory)
    weights = hugging_face_weights(directory)  # safetensors first; .bin files scanned
    with torch.random.fork_rng(devices=[]):
        if hf_config.model_type == "gpt2":
            gpt_config = _gpt_config_from_hf(hf_config)
            hf_gpt = transformers.GPT2LMHeadModel.from_pretrained(directory, **weights)
            gpt = GPTModel.build(gpt_config, device=device)
            gpt.load_state_dict(gpt_from_hf(hf_gpt.state_dict(), gpt_config), strict=True)
            return gpt
        if hf_config.model_type == "bert":
            bert_config = _bert_config_from_hf(hf_config)
            hf_bert = transformers.BertForPreTraining.from_pretrained(directory, **weights)
            bert = BertModel.build(bert_config, device=device)
            bert.load_state_dict(bert_from_hf(hf_bert.state_dict(), bert_config), strict=True)
            return bert
    raise ValueError(f"{directory}: model_type {hf_config.model_type!r} is not 'gpt2' or 'bert'")
