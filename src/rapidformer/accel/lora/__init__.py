"""Low-rank adapters (LoRA, DoRA, rsLoRA) on a frozen base, in PEFT's format on disk."""

from rapidformer.accel.lora.apply import FEATURE, apply_lora, lora_on

__all__ = ["FEATURE", "apply_lora", "lora_on"]
