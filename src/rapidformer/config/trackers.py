"""Which trackers --report-to names, and what it refuses before anything is built: a name
that is not a tracker, one that is not installed, and a tracker setting no chosen tracker
reads."""

from __future__ import annotations

import os
from collections.abc import Iterator

from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import Violation

TRACKERS = ("tensorboard", "jsonl", "mlflow", "wandb", "trackio")
"""What --report-to names (``all``: every one; ``none``: none)."""
TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb",
                   "trackio": "trackio"}  # fmt: skip


def reported_to(report_to: str) -> list[str]:
    """The trackers a --report-to value names, in the order given (``all``, ``none``)."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names == ["all"]:
        return list(TRACKERS)
    return [] if names == ["none"] else names


def tracker_violations(config: RapidformerConfig) -> Iterator[Violation]:
    """Trackers that exist and are installed, before anything is built; the file-writing ones
    need --save (the default, tensorboard and jsonl, then writes nothing)."""
    from importlib.util import find_spec

    logging, value = config.logging, config.logging.report_to
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [n for n in names if n not in (*TRACKERS, "all", "none")]
    if unknown or (len(names) > 1 and {"all", "none"} & set(names)):
        rule = f"{', '.join(unknown) or 'all or none'} is not a tracker here"
        if not unknown:
            rule = "all and none stand alone"
        fix = f"a comma list of {', '.join(TRACKERS)}, or all, or none"
        yield Violation("--report-to", value, rule, fix)
        return
    chosen = reported_to(value)
    missing = [n for n in chosen if find_spec(TRACKER_MODULES.get(n, "json")) is None]
    if missing:
        yield Violation(
            "--report-to",
            value,
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed",
            "pip install 'rapidformer[trackers]' (or drop the name)",
        )
    if (
        "mlflow" in chosen
        and config.checkpoint.save is None
        and not (logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    ):
        yield Violation(
            "--report-to",
            value,
            "MLflow records the run in a database under --save by default, and there is none",
            "pass --save DIR, or --mlflow-tracking-uri URI",
        )
    # A tracker's setting with none of its trackers chosen would do nothing: said, not ignored.
    named = ("mlflow", "wandb", "trackio")
    settings = (
        ("--mlflow-tracking-uri", logging.mlflow_tracking_uri, ("mlflow",)),
        ("--run-name", logging.run_name, named),
        ("--tracker-project", logging.tracker_project, named),
    )
    for flag, given, users in settings:
        if given is not None and not set(users) & set(chosen):
            yield Violation(
                flag,
                given,
                f"no tracker of --report-to={value!r} reads it (it names the run in "
                f"{', '.join(users)})",
                f"add {' or '.join(users)} to --report-to, or drop {flag}",
            )
