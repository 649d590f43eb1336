# Set-up and checks. `make demo` and `make test` each create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast coverage durations test-gpu gpu-wheels lint format docs docs-site bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so nothing below can pull a different (multi-GB) build.
	$(PY) -m pip install --quiet torch==2.13.0
	# The optional engines and trackers install too so that their tests run (DeepSpeed: a pure-Python wheel;
	# onnxruntime-training: wheels for Python 3.10/3.11 only, skipped elsewhere by a marker).
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,docs,deepspeed,onnx,trackers]'
	# Test-only reference: Megatron's own .bin/.idx reader and writer (pure Python; its
	# dependencies would pull a CUDA stack, and the indexed-dataset module needs none of them).
	$(PY) -m pip install --quiet --no-deps megatron-core==0.16.1
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf demo_output
	# 1. white-box: a Trainer subclass on generated data
	$(PY) examples/train_tiny_transformer.py --save demo_output/tiny
	# 2. black-box pretraining: corpus -> vocabulary -> .bin/.idx -> GPT -> Hugging Face export
	$(PY) examples/pretrain_gpt.py --out demo_output/pretrain
	# 3. black-box fine-tuning: that GPT classifies the grammar's sentences by verb (chance 0.25)
	$(PY) examples/finetune_classifier.py --out demo_output/finetune --model demo_output/pretrain/hf

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests examples benchmarks
	$(VENV)/bin/ruff format src tests examples benchmarks

# The whole suite (what CI runs): the 20 slowest tests printed, a test past 60 s fails
# (tests/helpers/budget.py).
test: $(STAMP) lint docs-site
	$(PY) -m pytest -q --durations=20

# The edit loop's tier, under 5 minutes: every test measured under 5 s in tests/durations.json.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=10

# Line and branch coverage of src/ over the whole suite (pyproject's [tool.coverage.run]).
coverage: $(STAMP)
	$(PY) -m pytest -q --cov=rapidformer --cov-report=term:skip-covered --cov-report=json:coverage.json

# Measure every test again (a full run) into tests/durations.json, which sets the tiers.
durations: $(STAMP)
	$(PY) -m pytest -q --write-durations tests/durations.json

# CUDA tests (tests/gpu/, ~3 min on one H200) on the GPU machine's own python3 and torch: no
# .venv is built there (no package registry). Without pytest on that image, carry the wheels
# `make gpu-wheels` puts in .gpu-wheels/ (pure Python) and they are installed first.
GPU_PYTHON ?= python3
test-gpu:
	@$(GPU_PYTHON) -c "import pytest" 2>/dev/null || \
	  $(GPU_PYTHON) -m pip install --quiet --no-index --find-links .gpu-wheels pytest || \
	  { echo "test-gpu: no pytest for $(GPU_PYTHON); run make gpu-wheels and carry .gpu-wheels"; exit 1; }
	PYTHONPATH=src:. $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu

gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --only-binary=:all: --no-deps -d .gpu-wheels \
	  pytest pluggy iniconfig packaging

docs: $(STAMP)
	$(PY) -m rapidformer.config.docs docs/parameters.md

# The docs site (mkdocs + Material over docs/, API pages from the docstrings) into site/;
# --strict fails on a broken link, anchor, nav entry or docstring reference.
docs-site: $(STAMP)
	# Not --quiet: it hides the warnings and with them the strict failure (mkdocs 1.6).
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/activation_memory.py
	$(PY) benchmarks/dynamic_shape.py
	$(PY) benchmarks/preprocess_throughput.py
	$(PY) benchmarks/optimizers.py
	$(PY) benchmarks/compile.py
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/ort_training.py
	$(PY) benchmarks/hf_architectures.py
	$(PY) benchmarks/precision.py
	# transformers' Trainer, the reference of this one, needs accelerate (not a rapidformer dependency)
	$(PY) -m pip install --quiet -c constraints.txt accelerate
	$(PY) benchmarks/finetune_vs_hf.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/memory_3d.py
	$(PY) benchmarks/pipeline_bubble.py
	$(PY) benchmarks/lm_loss_memory.py
	$(PY) benchmarks/lora.py
	$(PY) benchmarks/moe_balancing.py
	$(PY) benchmarks/loss_parity.py
	$(PY) benchmarks/choosing_switches.py
	$(PY) benchmarks/dry_run_accuracy.py
	# every chart again from the results just written (the throughput chart reads several)
	$(PY) benchmarks/charts.py

clean:
	rm -rf $(VENV) demo_output .pytest_cache .mypy_cache .ruff_cache
