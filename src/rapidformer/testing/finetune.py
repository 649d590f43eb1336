"""Tiny pretrained-model directories and small fine-tuning datasets, all made offline.

:func:`tiny_model` trains a tokenizer on the generated grammar of
:mod:`rapidformer.testing.corpus` and saves a randomly initialised BERT, GPT-2 or T5 (2 layers,
hidden 32 by default) with it, as ``save_pretrained`` would for a real checkpoint, so that
``--pretrained-model-name-or-path DIR`` works without the hub. :func:`task_dataset` writes
``train.jsonl`` and ``validation.jsonl`` for each fine-tuning task, built so that a tiny model
can learn them in a few hundred steps (tests check learning, not just running):

* sequence_classification: a sentence's label is its verb (4 verbs: chance 0.25);
* token_classification: tag the subject (SUBJ) and place (PLACE) phrases, the place first or
  last at random;
* question_answering: one sentence; "who / what / where is it?" asks for its subject, object
  or place (a random choice among the three spans: 33% exact match);
* masked_lm / causal_lm: the grammar's sentences;
* seq2seq_lm: sentence -> its place phrase.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rapidformer.testing.corpus import OBJECTS, PLACES, SUBJECTS, VERBS, synthetic_documents

MODEL_KINDS = ("bert", "gpt2", "t5", "llama", "mixtral", "qwen3_moe")
CLASS_VERBS = VERBS[:4]


def _texts(seed: int) -> list[str]:
    questions = [f"Where is {s}?" for s in SUBJECTS]
    return synthetic_documents(300, seed=seed) + questions


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
    """Save a random ``kind`` model ("bert", "gpt2" or "t5") and its tokenizer to ``out_dir``."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(kind, out / "vocab", vocab_size, seed)
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    model: Any
    if kind == "bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=2 * hidden,
                max_position_embeddings=max_positions,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=vocab,
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_positions=max_positions,
                resid_pdrop=dropout,
                embd_pdrop=dropout,
                attn_pdrop=dropout,
                bos_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    elif kind in _DECODERS:
        # Llama ships a tensor-parallel plan (base_model_tp_plan); Mixtral and Qwen3-MoE are
        # sparse MoE models (4 experts, top-2) that return a router loss.
        model_class, config_class, extra = _DECODERS[kind]
        decoder: dict[str, Any] = {
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "max_position_embeddings": max_positions,
            "attention_dropout": dropout,
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        config = getattr(transformers, config_class)(**decoder, **extra(hidden, heads))
        model = getattr(transformers, model_class)(config)
    elif kind == "t5":
        config = transformers.T5Config(
            vocab_size=vocab,
            d_model=hidden,
            d_kv=hidden // heads,
            d_ff=2 * hidden,
            num_layers=layers,
            num_heads=heads,
            dropout_rate=dropout,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        config.decoder_start_token_id = tokenizer.pad_token_id  # T5 starts decoding at pad
        model = transformers.T5ForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {MODEL_KINDS}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    return out


_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
_DECODERS: dict[str, tuple[str, str, Callable[[int, int], dict[str, Any]]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", lambda hidden, heads: {}),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        lambda hidden, heads: {"num_local_experts": 4, **_MOE},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        lambda hidden, heads: {
            "num_experts": 4,
            "moe_intermediate_size": hidden,
            "head_dim": hidden // heads,
            **_MOE,
        },
    ),
}
"""Decoder-only causal LMs built from the same shape: model class, config class, extras."""


def _tokenizer(kind: str, vocab_dir: Path, vocab_size: int, seed: int) -> Any:
    from rapidformer.data.tokenizers import build_tokenizer, train_tokenizer

    texts = _texts(seed)
    if kind in ("bert", "gpt2", "llama", "mixtral", "qwen3_moe"):
        name = "BertWordPieceLowerCase" if kind == "bert" else "GPT2BPETokenizer"
        vocab, merges = train_tokenizer(texts, name, str(vocab_dir), vocab_size=vocab_size)
        return build_tokenizer(name, vocab, merges).to_hf()
    # T5: a WordPiece vocabulary (no sentencepiece needed) with T5's special tokens: <pad> = 0
    # (also the decoder's start token), </s> = 1 appended to every sequence, <unk> = 2.
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


def _sentence(rng: random.Random, verb: str | None = None) -> tuple[str, str, str]:
    subject, place = rng.choice(SUBJECTS), rng.choice(PLACES)
    verb = verb or rng.choice(VERBS)
    return f"{subject} {verb} {rng.choice(OBJECTS)} {place}", subject, place


def task_rows(task: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` rows of ``task``'s learnable data (see the module docstring)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(count):
        if task == "sequence_classification":
            verb = rng.choice(CLASS_VERBS)
            text, _, _ = _sentence(rng, verb)
            rows.append({"text": text.capitalize() + ".", "label": verb})
        elif task == "token_classification":
            _, subject, place = _sentence(rng)
            rest = f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}".split()
            spans = [(subject.split(), "SUBJ"), (rest, None), (place.split(), "PLACE")]
            if rng.random() < 0.5:
                spans = [spans[2], spans[0], spans[1]]
            tokens: list[str] = []
            tags: list[str] = []
            for words, kind in spans:
                tokens += words
                tags += ["O"] * len(words) if kind is None else _iob(kind, len(words))
            rows.append({"tokens": tokens, "tags": tags})
        elif task == "question_answering":
            subject, verb, thing, place = (
                rng.choice(SUBJECTS),
                rng.choice(VERBS),
                rng.choice(OBJECTS),
                rng.choice(PLACES),
            )
            context = f"{subject} {verb} {thing} {place}.".capitalize()
            word, answer = rng.choice([("Who", subject), ("What", thing), ("Where", place)])
            start = context.lower().index(f" {answer}" if word != "Who" else answer)
            start += word != "Who"
            rows.append(
                {
                    "question": f"{word} is it?",
                    "context": context,
                    "answers": {
                        "text": [context[start : start + len(answer)]],
                        "answer_start": [start],
                    },
                }
            )
        elif task in ("masked_lm", "causal_lm", "casual_lm"):
            rows.append({"text": _sentence(rng)[0].capitalize() + "."})
        elif task == "seq2seq_lm":
            text, _, place = _sentence(rng)
            rows.append({"source": text.capitalize() + ".", "target": place})
        else:
            raise ValueError(f"unknown task {task!r}")
    return rows


def _iob(kind: str, length: int) -> list[str]:
    return [f"B-{kind}"] + [f"I-{kind}"] * (length - 1)


def task_dataset(
    task: str, out_dir: str | Path, *, train: int = 512, validation: int = 128, seed: int = 0
) -> Path:
    """Write ``train.jsonl`` and ``validation.jsonl`` of ``task`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, count, offset in (("train", train, 0), ("validation", validation, 1)):
        rows = task_rows(task, count, seed=seed * 2 + offset)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
