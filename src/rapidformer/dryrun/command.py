"""``rapidformer ... --dry-run``: the command's side of a dry run (world size, device size,
printing and saving)."""

from __future__ import annotations

import json
from pathlib import Path

from rapidformer.config.env import LaunchEnv
from rapidformer.config.root import RapidformerConfig
from rapidformer.dryrun import DryRunReport, dry_run
from rapidformer.dryrun.finetuning import finetuning_workload
from rapidformer.dryrun.fit import parse_memory
from rapidformer.dryrun.workload import check_task, pretraining_workload
from rapidformer.engine.validation import validate
from rapidformer.templates.finetuner import Finetuner
from rapidformer.templates.pretrainer import Pretrainer

REPORT_FILE = "dry_run.json"


def device_memory(config: RapidformerConfig) -> tuple[int | None, str]:
    """(bytes, where the figure comes from): --device-memory, else this machine's GPU."""
    text = config.planning.device_memory
    if text is not None:
        return parse_memory(text), f"--device-memory {text}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"detected: {props.name}"
    return None, "not given"


def run_dry_run(config: RapidformerConfig) -> DryRunReport:
    """The dry run the flags ask for: printed, and written to SAVE/dry_run.json with --save."""

    planning = config.planning
    world_size = planning.dry_run_world_size or LaunchEnv.read().world_size
    memory, source = device_memory(config)  # a bad --device-memory fails before any work
    check_task(config)
    pretraining = config.training.task == "pretraining"
    trainer = Pretrainer if pretraining else Finetuner
    config = trainer.config_defaults(config)  # what the run would fill in (a recipe's --lr)
    # Every flag checked as a real run checks it, before the model is built from them.
    extra = trainer.config_violations(config)
    validate(config, world_size, extra=extra, on_this_machine=False)
    warnings: list[str] = []
    if pretraining:
        work, model = pretraining_workload(config, warnings)
    else:
        work, model = finetuning_workload(config, warnings, world_size)
    report = dry_run(
        config,
        world_size,
        work,
        model,
        device_memory=memory,
        device_source=source,
        extra_violations=extra,
        warnings=warnings,
    )
    if config.checkpoint.save is not None and LaunchEnv.read().rank == 0:
        path = Path(config.checkpoint.save) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report
