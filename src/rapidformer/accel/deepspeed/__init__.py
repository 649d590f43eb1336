"""ZeRO through the DeepSpeed engine (``--zero-backend deepspeed``).

* :mod:`.engine`: the DeepSpeed config our flags mean, its forward-backward and step slots,
  and the backend's rules;
* :mod:`.state`: what DeepSpeed holds per rank, and its checkpoint format.
"""

from rapidformer.accel.deepspeed.engine import FEATURE, apply_deepspeed, apply_deepspeed_optimizer

__all__ = ["FEATURE", "apply_deepspeed", "apply_deepspeed_optimizer"]
