#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu/suite.py): one prepared run of a few minutes on one GPU.
#   benchmarks/gpu/run.sh            # full shapes; results in $OUT (default benchmarks/results/gpu)
#   benchmarks/gpu/run.sh --dry-run  # the same code paths on tiny shapes (CPU, < 2 min; CI runs it)
# Then benchmarks/gpu/engine_vs_hand.py: the engine's step against a hand-written loop.
# Uses .venv when there is one, else the python3 on PATH with the package from src/.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
# Compiled kernels are cached next to the results: the second compiled variant reuses them.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
PY
"$PY" benchmarks/gpu/suite.py --out "$OUT" "$@"
# The engine's step beside a hand-written loop of the same model (interleaved, repeated).
DRY=""
for arg in "$@"; do if [ "$arg" = "--dry-run" ]; then DRY="--dry-run"; fi; done
"$PY" benchmarks/gpu/engine_vs_hand.py --out "$OUT" $DRY
