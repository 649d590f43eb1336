#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu/suite.py) and the CUDA tests: one prepared run on one GPU.
#   benchmarks/gpu/run.sh            # full shapes; results in $OUT (default benchmarks/results/gpu)
#   benchmarks/gpu/run.sh --dry-run  # the same code paths on tiny shapes (CPU, < 2 min; CI runs it)
# Uses .venv when there is one, else the python3 on PATH with the package from src/.
# $OUT receives results only (gpu_suite.json / .md, test_gpu.txt): compile caches go to the
# temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/rapidformer-inductor}
DRY=""
for arg in "$@"; do if [ "$arg" = "--dry-run" ]; then DRY="--dry-run"; fi; done
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
PY
status=0
"$PY" benchmarks/gpu/suite.py --out "$OUT" "$@" || status=$?
if [ -z "$DRY" ]; then
  # The CUDA tests on the same machine (make test-gpu), their summary beside the results.
  make --no-print-directory test-gpu GPU_PYTHON="$PY" 2>&1 | tee "$OUT/test_gpu.txt" || status=1
fi
exit $status
