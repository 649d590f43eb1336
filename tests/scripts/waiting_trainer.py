"""The deterministic trainer, which waits before building its data until the file named by
``RAPIDFORMER_TEST_GO`` exists (when that variable is set): a run that holds its ``--save``
directory for as long as a test needs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rapidformer.cli import load_trainer_class

_Deterministic = load_trainer_class(str(Path(__file__).with_name("deterministic_trainer.py")))


class WaitingTrainer(_Deterministic):  # type: ignore[valid-type, misc]
    def build_data(self) -> Any:
        go = os.environ.get("RAPIDFORMER_TEST_GO")
        deadline = time.monotonic() + 300
        while go and not Path(go).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().build_data()
