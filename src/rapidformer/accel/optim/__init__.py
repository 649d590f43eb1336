"""The optimizer (``--optimizers``).

* :mod:`.optimizers`: AdamW or LAMB, fused or multi-tensor, and the step that builds it;
* :mod:`.lamb`: rapidformer's multi-tensor LAMB;
* :mod:`.partitioned`: ZeRO-1's optimizer-state partition for tensor-parallel, pipelined and
  expert-parallel models.
"""

from rapidformer.accel.optim.optimizers import FEATURE, apply_optimizer

__all__ = ["FEATURE", "apply_optimizer"]
