"""torch.compile (``--torch-compile`` and its ``--torch-compile-*`` flags).

* :mod:`.apply`: what is compiled (blocks or the whole model), and the flags' rules;
* :mod:`.watch`: how many graphs dynamo compiled, and every fall back to eager, made visible;
* :mod:`.generation_cache`: Hugging Face models train without their generation cache (it
  costs in training and makes every layer a new guard under compile).
"""

from rapidformer.accel.compile.apply import FEATURE, apply_compile, compiled_loss
from rapidformer.accel.compile.generation_cache import apply_no_generation_cache

__all__ = ["FEATURE", "apply_compile", "apply_no_generation_cache", "compiled_loss"]
