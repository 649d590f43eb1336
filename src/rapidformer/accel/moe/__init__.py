"""Mixture of experts (``--num-experts`` and the ``--moe-*`` flags).

* :mod:`.apply`: MoE layers swapped into the built-in models, expert parallelism;
* :mod:`.control`: the per-step bookkeeping the engine calls (loss scales, expert bias, routing
  statistics);
* :mod:`.rules`: what the flags mean and which combinations are refused;
* :mod:`.upcycling`: an MoE model started from a dense one.
"""

from rapidformer.accel.moe.apply import apply_expert_parallel, apply_moe
from rapidformer.accel.moe.rules import FEATURE

__all__ = ["FEATURE", "apply_expert_parallel", "apply_moe"]
