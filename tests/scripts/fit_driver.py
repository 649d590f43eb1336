"""A user's own script around a template's ``fit()``, run with a command line of flags: the
class the ``rapidformer`` command would run for them (the ``--user-script`` file's Trainer,
else the Pretrainer or the Finetuner by ``--task``), built and fitted at the top level with no
error handling of its own. tests/test_bad_inputs.py runs every bad input through it."""

from __future__ import annotations

import sys

from rapidformer import Finetuner, Pretrainer
from rapidformer.cli import load_trainer_class

args = sys.argv[1:]
script = args[args.index("--user-script") + 1] if "--user-script" in args else None
task = args[args.index("--task") + 1] if "--task" in args else None
if script is not None:
    template = load_trainer_class(script)
else:
    template = Pretrainer if task == "pretraining" else Finetuner
template(argv=args).fit()
