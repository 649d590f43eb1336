"""Built-in GPT and BERT written for parallelism, with Hugging Face conversion.

``GPTModel.build(config)`` / ``BertModel.build(config)`` construct on the meta device and
initialise deterministically; ``model.tp_plan`` declares the tensor-parallel split;
``model.blocks`` is the list of transformer blocks and every block has an ``ffn``.
The conversion functions live in :mod:`rapidformer.models.convert` (they need
``transformers`` only when building or reading Hugging Face models).
"""

from rapidformer.models.bert import BertConfig, BertModel
from rapidformer.models.convert import (
    bert_from_hf,
    bert_to_hf,
    export_hugging_face,
    gpt_from_hf,
    gpt_to_hf,
    hf_config_for,
    load_hugging_face,
)
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.models.layers import FeedForward, SelfAttention, TransformerBlock

__all__ = [
    "BertConfig",
    "BertModel",
    "FeedForward",
    "GPTConfig",
    "GPTModel",
    "SelfAttention",
    "TransformerBlock",
    "bert_from_hf",
    "bert_to_hf",
    "export_hugging_face",
    "gpt_from_hf",
    "gpt_to_hf",
    "hf_config_for",
    "load_hugging_face",
]
