"""The deterministic test Trainer with faults injected on cue, for the reliability tests
(``--user-script tests/scripts/faulty_trainer.py``).

Each fault is an environment variable ``STEP:RANK`` (the optimizer step, counted from 1, and
the rank of the whole job that suffers it, or several: ``0,1``); the fault fires when that
rank starts that step:

* ``FAULT_SIGNAL=STEP:RANK:NAME``: the rank sends itself the signal NAME (e.g. SIGTERM);
* ``FAULT_SIGNAL_LAUNCHER=STEP:RANK:NAME``: the rank sends its launcher (the process that
  started it: ``rapidformer --nproc-per-node``'s agent) the signal NAME;
* ``FAULT_NAN=STEPS:RANK``: the rank's loss is NaN in the steps listed (``3`` or ``3-12``);
* ``FAULT_RISE=STEPS:RANK``: the rank's loss is scaled by 1.05 ** step in the steps listed
  (a loss that keeps rising, as a learning rate too high leaves it);
* ``FAULT_NAN_PARAMETERS=STEP:RANK``: the rank's first parameter turns NaN (as a corrupted
  update would leave it);
* ``FAULT_KILL=STEP:RANK``: the rank dies by SIGKILL (only in torchrun's first attempt);
* ``FAULT_STALL=STEP:RANK``: the rank stops taking part until it receives a stop signal;
* ``FAULT_RAISE=STEP:RANK``: the rank's train_step raises RuntimeError.

``FAULT_SLOW_SAVES=SECONDS`` makes every ``torch.save`` sleep that long first (so that a kill
lands inside a checkpoint write more often). ``FAULT_DIGESTS=DIR`` writes, at the start of
every step, each rank's parameter digest to ``DIR/rank_R.jsonl`` (step -> SHA-256 of every
parameter's bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from rapidformer.cli import load_trainer_class
from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part

_Deterministic = load_trainer_class(str(Path(__file__).with_name("deterministic_trainer.py")))


if os.environ.get("FAULT_SLOW_SAVES"):
    _save, _pause = torch.save, float(os.environ["FAULT_SLOW_SAVES"])

    def _slow_save(*args: Any, **kwargs: Any) -> None:
        time.sleep(_pause)
        _save(*args, **kwargs)

    torch.save = _slow_save


def _steps(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def _fault(name: str, step: int, rank: int) -> list[str] | None:
    """The fields after STEP:RANK of fault ``name`` when it fires at this step and rank."""
    spec = os.environ.get(name)
    if not spec:
        return None
    steps, fault_rank, *rest = spec.split(":")
    ranks = {int(r) for r in fault_rank.split(",")}
    return rest if step in _steps(steps) and rank in ranks else None


class FaultyTrainer(_Deterministic):  # type: ignore[valid-type, misc]
    _started: int = 0

    def train_step(self, batch: Any) -> torch.Tensor:
        loss = super().train_step(batch)
        if not self.model.training:  # evaluation: no faults
            return loss
        step, rank = self.engine.steps_done + 1, process_group.rank()
        if self._started != step:  # the first micro-batch of a step
            self._started = step
            self._start_of_step(step, rank)
        if _fault("FAULT_NAN", step, rank) is not None:
            loss = loss * float("nan")
        if _fault("FAULT_RISE", step, rank) is not None:
            loss = loss * 1.05**step
        return loss

    def _start_of_step(self, step: int, rank: int) -> None:
        digests = os.environ.get("FAULT_DIGESTS")
        if digests:
            digest = hashlib.sha256()
            for param in self.engine.state.parameters:
                digest.update(local_part(param).detach().cpu().numpy().tobytes())
            with open(Path(digests) / f"rank_{rank}.jsonl", "a") as out:
                out.write(json.dumps({"step": step, "digest": digest.hexdigest()}) + "\n")
        fired = _fault("FAULT_SIGNAL", step, rank)
        if fired is not None:
            os.kill(os.getpid(), getattr(signal, fired[0]))
        fired = _fault("FAULT_SIGNAL_LAUNCHER", step, rank)
        if fired is not None:
            os.kill(os.getppid(), getattr(signal, fired[0]))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if _fault("FAULT_KILL", step, rank) is not None and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        if _fault("FAULT_STALL", step, rank) is not None:
            # Stuck until torchrun's agent, once a peer gave up, asks it to stop: it then
            # leaves at once instead of making the agent wait 30 s before SIGKILL.
            while self.engine.stop_signal is None:
                time.sleep(0.05)
            os._exit(1)
        if _fault("FAULT_NAN_PARAMETERS", step, rank) is not None:
            with torch.no_grad():
                local_part(self.engine.state.parameters[0]).fill_(float("nan"))
        if _fault("FAULT_RAISE", step, rank) is not None:
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
