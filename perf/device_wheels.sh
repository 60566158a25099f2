#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels a GPU machine without internet lacks for the server, the tests and
# the GGUF loader: a torch + transformers + huggingface_hub image has numpy, pydantic, httpx, anyio, tqdm, pyyaml
# and typing_extensions, but not these. Run it on a machine with a package index, then carry .whl/ along and
# install there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#
#   perf/device_wheels.sh [--python PY] [--dest DIR]
#
# Binary wheels only (the target has no compilers for Python packages worth relying on), for CPython 3.12 on
# manylinux x86_64; --no-deps because each dependency the image may lack is named here explicitly (pulling the
# whole tree would re-download torch-sized packages the image already has). One pinned version each: the versions
# the dev venv tests with, so the GPU machine runs what was tested.
set -euo pipefail

PY=python3
DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "device_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PKGS=(
  # the server
  falcon==4.4.0
  gunicorn==27.0.1
  prometheus_client==0.26.0
  # the GGUF loader (setup.cfg: gguf>=0.19,<0.20); its requests import is lazy (downloads only)
  gguf==0.19.0
  # structured output
  llguidance==1.9.1
  # the tests' OpenAI client and its requirements outside the image: openai's HTTP stack is httpx2 (not httpx),
  # httpx2 -> httpcore2 -> truststore; jiter is compiled; sniffio is a direct requirement newer anyio dropped
  openai==3.63.0
  jiter==0.19.0
  # the image has no pydantic (openai's models): pydantic with its compiled core and two pure helpers
  pydantic==2.14.4
  pydantic_core==2.50.5
  annotated_types==0.8.0
  typing_inspection==0.4.5
  httpx2==2.17.0
  httpcore2==2.17.0
  truststore==0.10.5
  sniffio==1.3.1
  # the structured-output tests' schema validator (tests/test_server_device.py) and its requirements
  jsonschema==4.26.0
  jsonschema_specifications==2025.9.1
  referencing==0.37.0
  rpds_py==2026.9.1
  attrs==26.1.0
  # the Vulkan backend's bindings
  vulkan==1.3.275.1
  cffi==2.1.1
  pycparser==3.12
  # the sampling profiler perf/gpu_check.py serving --profile-concurrency attaches to the server's processes
  py-spy==0.4.3
)

# Newest glibc tags first; pip takes the first wheel that any listed tag matches. Pure-python wheels
# (py3-none-any) and abi3 wheels match as well.
PLATFORMS=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

mkdir -p "$DEST"
failed=()
for spec in "${PKGS[@]}"; do
  name=${spec%%==*}
  # a wheel of another version of the same package would be installed too (pip install .whl/*.whl): drop it
  norm=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
  for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f" | tr '[:upper:]-' '[:lower:]_')
    ver=${spec#*==}
    case "$base" in
      "${norm}_${ver}_"*) ;;
      "${norm}_"[0-9]*) echo "removing stale $f"; rm -f "$f" ;;
    esac
  done
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
       "${PLATFORMS[@]}" -d "$DEST" "$spec"; then
    failed+=("$spec")
  fi
done

echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "total: $(awk -v b="$total" 'BEGIN { printf "%.1f MiB (%d bytes)", b / 1048576, b }')"
if [ ${#failed[@]} -gt 0 ]; then
  echo "device_wheels.sh: no cp312 manylinux x86_64 wheel found for: ${failed[*]}" >&2
  exit 1
fi
