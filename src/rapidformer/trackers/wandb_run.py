"""Weights & Biases: offline unless the environment says otherwise (``WANDB_MODE``), so a run
never reaches the network by surprise; ``wandb sync SAVE/wandb/offline-run-*`` uploads it later.
The project and name come from the flags, else ``WANDB_PROJECT`` and ``WANDB_NAME``. The run's
id is kept in each checkpoint: a resumed rapidformer run logs to the same W&B run (offline, a
new run directory with the same id, which ``wandb sync`` merges)."""

from __future__ import annotations

import os
from typing import Any

from rapidformer.trackers.tracker import TrackedRun, scalars


class WandbTracker:
    """One W&B run (rank 0's)."""

    name = "wandb"

    def __init__(self, run: TrackedRun) -> None:
        import wandb
        from wandb.sdk.lib.runid import generate_id

        mode = os.environ.get("WANDB_MODE", "offline")
        self.run_id: str | None = run.resume_ids.get(self.name) or generate_id()
        self._run = wandb.init(
            mode=mode,  # type: ignore[arg-type]
            dir=run.save_dir,
            project=run.project or os.environ.get("WANDB_PROJECT") or "rapidformer",
            name=run.name if run.name and not os.environ.get("WANDB_NAME") else None,
            id=self.run_id,
            resume="allow",
            config={**run.config, "run_plan": "\n".join(run.plan)},
            settings=wandb.Settings(silent=not run.verbose, console="off"),
            reinit="create_new",
        )
        self.where = f"W&B ({mode}, {self._run.dir})"

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self._run.log(scalars(kind, record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()
