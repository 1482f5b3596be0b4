#!/usr/bin/env bash
# The GPU check's software rehearsed on a CPU, before a GPU's scarce minutes are spent on it:
#
#   scripts/gpu_rehearsal.sh [ENV] [OUT]   (defaults: /tmp/vkv-gpu-image, gpu-rehearsal/)
#
# (IMAGE_PYTHON: the image's Python, 3.12, by version or path; uv finds or downloads it.)
# The lent GPU machines run an image whose Python packages are not this tree's uv.lock (read off
# such a machine: ../.library/device/KINDS.md): older torch, Triton and transformers, and no
# fastapi, openai, selenium or jsonschema. This script builds a virtual environment with those
# versions (uv, from the package registry) and runs, in it:
#
# 1. scripts/compile_for_gpu.py: every Triton launch compiled for sm_90 by the image's Triton
#    (OUT/compile.log);
# 2. gpu_check.sh's tests stage (GPU_CHECK_ON_CPU=1): the same tests, on the CPU under the
#    Triton interpreter, summarized as on the GPU (files whose imports are missing: not run).
#
# What it cannot rehearse is the GPU itself: compiled kernels' results, CUDA graphs, timings.
# One difference from the image: numpy 2.3, not 2.5, because Triton 3.6's interpreter converts
# one-element arrays to Python integers, which numpy 2.4 refuses (the image runs no
# interpreter). Exit status: compile_for_gpu.py's if it failed, else gpu_check.sh's.
set -uo pipefail
cd "$(dirname "$0")/.."
ENV=${1:-/tmp/vkv-gpu-image}
OUT=${2:-gpu-rehearsal}
IMAGE_PACKAGES=(
    torch==2.11.0 triton==3.6.0 transformers==5.17.0 safetensors==0.8.0 tokenizers==0.23.2
    numpy==2.3.5 xxhash rich prometheus-client psutil matplotlib httpx
    pytest pytest-xdist pytest-timeout hypothesis
)
uv venv -q --allow-existing -p "${IMAGE_PYTHON:-3.12}" "$ENV" || exit 1
VIRTUAL_ENV=$ENV uv pip install -q "${IMAGE_PACKAGES[@]}" || exit 1
mkdir -p "$OUT"
echo "gpu_rehearsal: compile_for_gpu.py with $("$ENV/bin/python" -c 'import triton; print("Triton", triton.__version__)') (log: $OUT/compile.log)" >&2
PYTHONPATH=$PWD "$ENV/bin/python" scripts/compile_for_gpu.py >"$OUT/compile.log" 2>&1
status=$?
tail -1 "$OUT/compile.log"
[ "$status" = 0 ] || exit "$status"
GPU_CHECK_ON_CPU=1 PYTHON=$ENV/bin/python scripts/gpu_check.sh "$OUT"
