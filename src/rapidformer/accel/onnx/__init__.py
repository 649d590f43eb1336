"""ONNX Runtime training (``--onnx-runtime-training``).

* :mod:`.training`: the forward-backward slot that runs ``train_step`` in ONNX Runtime, and
  the flag's rules;
* :mod:`.export`: the export of ``train_step`` and its gradient graph;
* :mod:`.graph`: fixes to the exported graph that ONNX Runtime's gradient builder needs.
"""

from rapidformer.accel.onnx.training import FEATURE, apply_onnxruntime

__all__ = ["FEATURE", "apply_onnxruntime"]
