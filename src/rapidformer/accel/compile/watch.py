"""Compile made visible: how many graphs dynamo compiled, and every fall back to eager.

``torch.compile`` fails quietly by design: when a function needs more graphs than dynamo's
recompile limit (8 by default), dynamo logs one warning and runs that function eagerly from
then on. A Hugging Face decoder with its generation cache on did exactly that: each layer's
cache object was a new guard, the shared block graph recompiled per layer, and from the ninth
layer on the blocks ran uncompiled, and the run was slower than a hand-compiled model with
nothing said.

:class:`CompileWatch` is a step monitor (``state.monitors``): after the first step it logs how
many graphs the run compiled, and from then on every recompile-limit hit is logged as a
warning naming the function and dynamo's reason, and counted in the metrics
(``compile_graphs``, ``compile_fallbacks``) of every log line.
"""

from __future__ import annotations

import logging
from typing import Any

from rapidformer.log import log

_DYNAMO_LOGGER = "torch._dynamo.convert_frame"
"""Where dynamo reports a recompile-limit hit (torch 2.13: ``torch._dynamo hit config.
recompile_limit``)."""


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far.

    torch 2.13 has no public counter: this reads dynamo's own statistics, the one use of them
    (tests/test_torch_internals.py fails clearly if torch moves them)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _LimitHits(logging.Handler):
    """Collects dynamo's recompile-limit warnings (one entry per function)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" not in message and "cache_size_limit" not in message:
            return
        lines = message.splitlines()
        function = next((ln.split(":", 1)[1].strip() for ln in lines if "function:" in ln), "?")
        reason = next((ln.split(":", 1)[1].strip() for ln in lines if "last reason:" in ln), "")
        self.hits.setdefault(function, f"{lines[0].strip()}; last reason: {reason}")


class CompileWatch:
    """Counts compiled graphs and recompile-limit hits from compose() on; see the module
    docstring."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.baseline = compiled_graphs()
        self.first_step_seen = False
        self.reported: set[str] = set()
        self.handler = _LimitHits()
        logging.getLogger(_DYNAMO_LOGGER).addHandler(self.handler)

    @property
    def graphs(self) -> int:
        """Graphs compiled since compose() (forward graphs; backward ones are derived)."""
        return compiled_graphs() - self.baseline

    @property
    def fallbacks(self) -> dict[str, str]:
        """Functions that hit the recompile limit (they run eagerly now) -> why."""
        return dict(self.handler.hits)

    def after_step(self, step: int, main_process: bool) -> None:
        """Log the graph count after the first step (of this process: a resumed run's too)
        and any new fallback at once."""
        if main_process and not self.first_step_seen:
            log.info(
                "compile (%s scope): %d graph(s) compiled by step %d%s",
                self.scope,
                self.graphs,
                step,
                "" if not self.handler.hits else f"; {len(self.handler.hits)} fell back to eager",
            )
        self.first_step_seen = True
        for function, reason in self.handler.hits.items():
            if function in self.reported:
                continue
            self.reported.add(function)
            if main_process:
                log.warning(
                    "torch.compile FELL BACK TO EAGER for %s: %s. Its calls now run "
                    "uncompiled. Fix: give it fewer distinct inputs (e.g. use_cache=False, "
                    "--data-iterator dynamic-shape buckets) or raise "
                    "torch._dynamo.config.recompile_limit",
                    function,
                    reason,
                )

    def metrics(self) -> dict[str, Any]:
        return {"compile_graphs": self.graphs, "compile_fallbacks": len(self.handler.hits)}

    def close(self) -> None:
        logging.getLogger(_DYNAMO_LOGGER).removeHandler(self.handler)
