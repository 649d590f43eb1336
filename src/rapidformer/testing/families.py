"""Tiny Hugging Face models of twelve families, built offline and saved as a hub checkpoint would
be (config.json, weights, tokenizer files), so that ``--pretrained-model-name-or-path DIR`` works
without the hub.

Each family is saved with its pretraining head (``BertForMaskedLM``, ``LlamaForCausalLM``,
``BartForConditionalGeneration`` ...) and a tokenizer trained on the generated grammar of
:mod:`rapidformer.testing.corpus` that behaves like the family's own in what fine-tuning relies
on: its special tokens and their ids, the inputs it returns (RoBERTa, BART, ModernBERT and the
decoders return no ``token_type_ids``; ModernBERT's forward does not even accept them), and
pair templates. The vocabularies are small and the weights random: these models test code
paths and learning, not language.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidformer.testing.corpus import SUBJECTS, synthetic_documents


@dataclass(frozen=True)
class Shape:
    """What every family's config is built from."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    dropout: float
    max_positions: int
    pad: int
    bos: int
    eos: int


@dataclass(frozen=True)
class Family:
    model_class: str
    """The class saved: the family's pretraining head."""
    config_class: str
    config: Callable[[Shape], dict[str, Any]]
    tokenizer: str
    """One of ``wordpiece`` (BERT's), ``wordpiece-no-types`` (ModernBERT's inputs), ``bpe``
    (GPT-2's byte-level BPE), ``roberta`` (byte-level BPE with <s> <pad> </s> <unk> <mask>),
    ``t5`` (<pad> </s> <unk>, </s> appended)."""


def _bert(s: Shape) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "intermediate_size": 2 * s.hidden,
        "max_position_embeddings": s.max_positions,
        "hidden_dropout_prob": s.dropout,
        "attention_probs_dropout_prob": s.dropout,
        "pad_token_id": s.pad,
    }


def _roberta(s: Shape) -> dict[str, Any]:
    # Positions start after the padding index, as in the released checkpoints (514 = 512 + 2).
    return {
        **_bert(s),
        "max_position_embeddings": s.max_positions + s.pad + 1,
        "type_vocab_size": 1,
        "bos_token_id": s.bos,
        "eos_token_id": s.eos,
    }


def _deberta_v2(s: Shape) -> dict[str, Any]:
    # DeBERTa-v3's layout: relative attention with log buckets, no absolute positions.
    return {
        **_bert(s),
        "relative_attention": True,
        "position_buckets": 32,
        "max_relative_positions": -1,
        "pos_att_type": ["p2c", "c2p"],
        "position_biased_input": False,
        "type_vocab_size": 0,
        "norm_rel_ebd": "layer_norm",
        "share_att_key": True,
    }


def _modernbert(s: Shape) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": 2 * s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "max_position_embeddings": s.max_positions,
        # One global and one sliding-window layer (window 16), as the released model
        # alternates them (every third layer global there).
        "global_attn_every_n_layers": 2,
        "local_attention": 16,
        "attention_dropout": s.dropout,
        "mlp_dropout": s.dropout,
        "embedding_dropout": s.dropout,
        "pad_token_id": s.pad,
        "cls_token_id": s.bos,
        "sep_token_id": s.eos,
        "bos_token_id": s.bos,
        "eos_token_id": s.eos,
    }


def _gpt2(s: Shape) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "n_embd": s.hidden,
        "n_layer": s.layers,
        "n_head": s.heads,
        "n_positions": s.max_positions,
        "resid_pdrop": s.dropout,
        "embd_pdrop": s.dropout,
        "attn_pdrop": s.dropout,
        "bos_token_id": s.eos,
        "eos_token_id": s.eos,
        "pad_token_id": s.pad,
    }


def _decoder(**extra: Any) -> Callable[[Shape], dict[str, Any]]:
    """Llama-style decoders (RMSNorm, rotary, SwiGLU, grouped-query attention)."""

    def config(s: Shape) -> dict[str, Any]:
        return {
            "vocab_size": s.vocab,
            "hidden_size": s.hidden,
            "intermediate_size": 2 * s.hidden,
            "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.heads // 2,
            "max_position_embeddings": s.max_positions,
            "attention_dropout": s.dropout,
            "bos_token_id": s.eos,
            "eos_token_id": s.eos,
            "pad_token_id": s.pad,
            **{k: v(s) if callable(v) else v for k, v in extra.items()},
        }

    return config


def _t5(s: Shape) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "d_model": s.hidden,
        "d_kv": s.hidden // s.heads,
        "d_ff": 2 * s.hidden,
        "num_layers": s.layers,
        "num_heads": s.heads,
        "dropout_rate": s.dropout,
        "pad_token_id": s.pad,
        "eos_token_id": s.eos,
        "decoder_start_token_id": s.pad,  # T5 starts decoding at <pad>
    }


def _bart(s: Shape) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "d_model": s.hidden,
        "encoder_layers": s.layers,
        "decoder_layers": s.layers,
        "encoder_attention_heads": s.heads,
        "decoder_attention_heads": s.heads,
        "encoder_ffn_dim": 2 * s.hidden,
        "decoder_ffn_dim": 2 * s.hidden,
        "max_position_embeddings": s.max_positions,
        "dropout": s.dropout,
        "attention_dropout": s.dropout,
        "activation_dropout": s.dropout,
        "pad_token_id": s.pad,
        "bos_token_id": s.bos,
        "eos_token_id": s.eos,
        "decoder_start_token_id": s.eos,  # BART starts decoding at </s>
        "forced_eos_token_id": s.eos,
    }


_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}

FAMILIES: dict[str, Family] = {
    # encoders
    "bert": Family("BertForMaskedLM", "BertConfig", _bert, "wordpiece"),
    "roberta": Family("RobertaForMaskedLM", "RobertaConfig", _roberta, "roberta"),
    "deberta_v2": Family("DebertaV2ForMaskedLM", "DebertaV2Config", _deberta_v2, "wordpiece"),
    "modernbert": Family(
        "ModernBertForMaskedLM", "ModernBertConfig", _modernbert, "wordpiece-no-types"
    ),
    # decoders (Llama ships a tensor-parallel plan; Mixtral and Qwen3-MoE are sparse MoE models,
    # 4 experts, top-2, that return a router loss)
    "gpt2": Family("GPT2LMHeadModel", "GPT2Config", _gpt2, "bpe"),
    "llama": Family("LlamaForCausalLM", "LlamaConfig", _decoder(), "bpe"),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", _decoder(), "bpe"),
    "mistral": Family("MistralForCausalLM", "MistralConfig", _decoder(sliding_window=32), "bpe"),
    "mixtral": Family(
        "MixtralForCausalLM", "MixtralConfig", _decoder(num_local_experts=4, **_MOE), "bpe"
    ),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        _decoder(
            num_experts=4,
            moe_intermediate_size=lambda s: s.hidden,
            head_dim=lambda s: s.hidden // s.heads,
            **_MOE,
        ),
        "bpe",
    ),
    # encoder-decoders
    "t5": Family("T5ForConditionalGeneration", "T5Config", _t5, "t5"),
    "bart": Family("BartForConditionalGeneration", "BartConfig", _bart, "roberta"),
}

MODEL_KINDS = tuple(FAMILIES)


def tiny_model(
    kind: str,
    out_dir: str | Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    dropout: float = 0.0,
    max_positions: int = 128,
    vocab_size: int = 300,
    seed: int = 0,
) -> Path:
    """Save a random ``kind`` model (one of :data:`MODEL_KINDS`) and its tokenizer to
    ``out_dir``; returns ``out_dir``."""
    from rapidformer.quiet import quiet_third_parties

    # A user's data script calls this before anything else: as quiet as a run.
    quiet_third_parties()
    import torch
    import transformers

    family = FAMILIES.get(kind)
    if family is None:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {', '.join(MODEL_KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(family.tokenizer, out / "vocab", vocab_size, seed)
    shape = Shape(
        vocab=len(tokenizer),
        hidden=hidden,
        layers=layers,
        heads=heads,
        dropout=dropout,
        max_positions=max_positions,
        pad=tokenizer.pad_token_id,
        bos=tokenizer.bos_token_id
        if tokenizer.bos_token_id is not None
        else tokenizer.cls_token_id,
        eos=tokenizer.eos_token_id
        if tokenizer.eos_token_id is not None
        else tokenizer.sep_token_id,
    )
    torch.manual_seed(seed)
    config = getattr(transformers, family.config_class)(**family.config(shape))
    model = getattr(transformers, family.model_class)(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    return out


def _texts(seed: int) -> list[str]:
    questions = [f"Where is {s}?" for s in SUBJECTS]
    return synthetic_documents(300, seed=seed) + questions


def _tokenizer(kind: str, vocab_dir: Path, vocab_size: int, seed: int) -> Any:
    from rapidformer.data.tokenizers import build_tokenizer, train_tokenizer

    texts = _texts(seed)
    if kind in ("wordpiece", "wordpiece-no-types", "bpe"):
        name = "GPT2BPETokenizer" if kind == "bpe" else "BertWordPieceLowerCase"
        vocab, merges = train_tokenizer(texts, name, str(vocab_dir), vocab_size=vocab_size)
        hf = build_tokenizer(name, vocab, merges).to_hf()
        if kind == "wordpiece-no-types":
            hf.model_input_names = ["input_ids", "attention_mask"]
            hf.init_kwargs["model_input_names"] = hf.model_input_names  # saved with it
        return hf
    if kind == "roberta":
        # Byte-level: the 256-byte alphabet comes on top, else few merges are left.
        return _roberta_tokenizer(texts, vocab_size + 256)
    if kind == "t5":
        return _t5_tokenizer(texts, vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def _roberta_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE with RoBERTa's (and BART's) specials: <s>=0 <pad>=1 </s>=2 <unk>=3
    <mask>=4; ``<s> A </s>`` and ``<s> A </s></s> B </s>``; no token_type_ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    # A space before every word, the first too: words tokenize alike wherever they stand,
    # which token classification on pre-split words relies on.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
        model_input_names=["input_ids", "attention_mask"],
    )


def _t5_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A WordPiece vocabulary (no sentencepiece needed) with T5's special tokens: <pad> = 0
    (also the decoder's start token), </s> = 1 appended to every sequence, <unk> = 2."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="<unk>"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"])
    backend.train_from_iterator(texts, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
