"""Pipeline parallelism (``--pipeline-model-parallel-size``).

* :mod:`.schedule`: the step that cuts the model into this rank's stages, the forward-backward
  slot that runs them through a torch pipeline schedule, and the flags' rules;
* :mod:`.layout`: which layers each stage holds, which rank holds each stage, the bubble;
* :mod:`.model`: a rank's stages callable as the whole model (evaluation).
"""

from rapidformer.accel.pipeline.schedule import FEATURE, apply_pipeline

__all__ = ["FEATURE", "apply_pipeline"]
