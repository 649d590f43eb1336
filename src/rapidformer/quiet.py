"""What third-party libraries print that a user did not come to read: off unless --verbose.

A run's output is the plan and the progress. Around them, on every start:

* torchao, which transformers imports whenever it is installed, warns once for every compiled
  extension its wheel carries for another Python or CUDA ("Failed to load ..._C_mxfp8...");
* torch's pytree warns that torchao registers Enum constants the old way;
* DeepSpeed, which transformers (through accelerate) imports whenever it is installed, says it
  fell back to the CPU accelerator, in runs that do not use DeepSpeed;
* transformers draws progress bars for loading and writing weights, and a LOAD REPORT table of
  the checkpoint's tensors the model did not use and the ones it initialised (the Finetuner
  says that in one line of its own: ``new: classifier.weight (4 x 64) ...``).

:func:`quiet_third_parties` filters those before the libraries load: the torchao, pytree and
DeepSpeed notices by name; for transformers and the hub, everything below an error (its
warnings too) and every progress bar (a download's too), through ``TRANSFORMERS_VERBOSITY`` and
``HF_HUB_DISABLE_PROGRESS_BARS``, which the process's children inherit (a user's own setting of
either wins). Errors always show; ``--verbose`` leaves everything as the libraries print it.
rapidformer itself imports none of its optional engines (DeepSpeed, ONNX Runtime, torchao,
Liger) unless their switch is on.
"""

from __future__ import annotations

import logging
import os
import sys

_quiet: list[bool] = [False]


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_third_parties(verbose: bool = False) -> None:
    """Filter the notices above (idempotent); nothing with ``verbose``."""
    if verbose or _quiet[0]:
        return
    _quiet[0] = True
    # torchao logs through its module logger, and does not set its level: warnings below
    # errors go. torch's pytree deprecation notice the same way.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # DeepSpeed sets its logger's level when it loads: a filter on the logger object stays.
    logging.getLogger("DeepSpeed").addFilter(_DropMessages("Setting accelerator to CPU"))
    # transformers and huggingface_hub read these when they load (a user's setting wins).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # loaded already: tell it directly
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
