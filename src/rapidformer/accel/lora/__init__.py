"""Low-rank adapters (LoRA, DoRA, rsLoRA) on a frozen base, in PEFT's format on disk.

``apply`` attaches them (``layer``: the adapter on one linear layer; ``targets``: which layers;
``quantize``: how the frozen base is stored; ``start``: their first values), ``slot`` is how
code that knows only the base reaches them (``aside`` takes them off while it splits or
initialises a model), ``rules`` says where they can run, ``settings`` what a run trains,
``peft_format`` and ``saving`` read and write them (``EXPORT``: what export asks of them).
"""

from rapidformer.accel.lora.apply import apply_lora
from rapidformer.accel.lora.rules import FEATURE, lora_on
from rapidformer.accel.lora.saving import EXPORT

__all__ = ["EXPORT", "FEATURE", "apply_lora", "lora_on"]
