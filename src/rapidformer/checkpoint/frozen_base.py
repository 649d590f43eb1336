"""The frozen base a checkpoint of adapters records, and the resume that must match it: a
checkpoint of added parameters resumes only on the base it was trained on, with the same
additions, and a whole model's checkpoint only without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidformer.errors import CheckpointError
from rapidformer.state import TrainState


def base_record(state: TrainState) -> dict[str, Any] | None:
    """What a checkpoint records of the run's frozen base (None without one)."""
    base = state.frozen_base
    if base is None:
        return None
    return {
        "source": base.source,
        "sha256": base.fingerprint,
        "adapter": base.adapter_config,
        "model_config": base.model_config,
    }


def check_base(path: Path, state: TrainState, record: dict[str, Any]) -> None:
    """A checkpoint of adapters resumes only on the base it was trained on, with adapters
    that compute the same, and a whole model's checkpoint only without adapters: refused
    before anything is read."""
    saved, running = record.get("frozen_base"), base_record(state)
    if saved is None and running is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{path} holds a whole model, and this run trains adapters on a frozen base. Fix: "
            "start from its weights instead (export it, then --pretrained-model-name-or-path)"
        )
    if running is None:
        raise CheckpointError(
            f"{path} holds adapters on the base {saved['source']}. Fix: resume it with the "
            "adapter flags it was saved with (its progress.json holds them), or export it "
            "merged into its base first (python -m rapidformer.export --help)"
        )
    assert state.frozen_base is not None
    differ = [
        f"{key} {saved['adapter'].get(key)!r} there, {running['adapter'].get(key)!r} here"
        for key in state.frozen_base.defining_keys
        if saved["adapter"].get(key) != running["adapter"].get(key)
    ]
    if differ:
        raise CheckpointError(
            f"{path} holds other adapters than this run makes ({'; '.join(differ)}). Fix: "
            "resume with the adapter flags it was saved with (its progress.json holds them)"
        )
    # Checked after what the adapters compute: adapters of another kind are not "another base".
    if saved["sha256"] != running["sha256"]:
        raise CheckpointError(
            f"{path} holds adapters trained on another base: it was saved on {saved['source']} "
            f"(sha256 {saved['sha256'][:12]}), this run's base {running['source']} is "
            f"{running['sha256'][:12]}. Fix: resume with the base it was trained on"
        )
