#!/usr/bin/env bash
# The GPU path, checked and measured in one command on a machine with a CUDA GPU:
#
#   scripts/gpu_check.sh [OUT]        (default OUT: gpu-check/)
#   STAGES="decode_kernel e2e" scripts/gpu_check.sh OUT    (only those stages)
#
# The stages run in this order, those that measure issue 43's bars first:
# 1. decode_kernel: benchmarks/bench_decode_kernel.py, the paged decode kernel's bandwidth,
#    16-bit and quantized;
# 2. decode_step: benchmarks/bench_decode_step.py on Qwen3-0.6B's shape (random weights,
#    nano-vLLM's lengths, 128 requests): 16-bit from CUDA graphs and eager, INT8 and INT4;
#    tokens/s, a full-batch decode step's time and GPU-busy share;
# 3. e2e: `vkv bench e2e --device cuda` on the same weights and lengths against transformers;
# 4. host: benchmarks/bench_step_overhead.py --gpu-path on the same shape and lengths, 128
#    sequences replayed from CUDA graphs: the host's work in a full decode step, phase by phase
#    ("sample" holds the wait for the GPU);
# 5. tests: the GPU-path tests (tests/runtime, Phase 3's graded and hidden tests) with CUDA
#    present (the CUDA-graph test and the Triton layer ops among them);
# 6. decode_sweep: bench_decode_kernel.py --sweep, each format's fastest launch options (tokens
#    a tile, warps, stages, keys per channel folded or not, a quantized format's per-token
#    scales folded or not) against the defaults (saved after each format: one cut short keeps
#    the formats before it, 16-bit and per token first);
# 7. startup: how long LLM() takes to start with vkv-tiny (the bar: 10 s).
#
# All stages' limits add up to about 18 minutes, more than one 10-minute call on a lent
# device: run them as two calls, the bars first (STAGES="decode_kernel decode_step e2e", at
# most 560 s, then STAGES="host tests decode_sweep startup", at most 540 s, the same OUT); the
# summary reads what is there. OUT/stages.txt gives each stage's exit status and seconds.
#
# Runs with the machine's own python3 (torch, Triton, transformers, pytest), no uv, the tree on
# PYTHONPATH; set PYTHON to use another interpreter. Each stage has a time limit. A test file
# whose imports are missing there (the server's fastapi, the browser tests' selenium, ...) is
# not run, and OUT/gpu_check.json says which and why, with every figure of the run. Exit status: 0 when every stage ran and no test failed, 1 otherwise,
# 2 without a CUDA GPU. With GPU_CHECK_ON_CPU=1 (scripts/gpu_rehearsal.sh), the tests stage
# alone, on the CPU under the Triton interpreter: the device image's software, rehearsed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PYTHON=${PYTHON:-python3}
# absolute: tests start processes in other folders
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export VKV_GPU_CHECK_OUT=$OUT

WORKERS=8 TESTS_LIMIT=210 ON_CPU=${GPU_CHECK_ON_CPU:-}
unset GPU_CHECK_ON_CPU  # not for the tests' own runs of this script
if [ -n "$ON_CPU" ]; then  # scripts/gpu_rehearsal.sh: the tests, interpreted
    STAGES=tests WORKERS=$(nproc) TESTS_LIMIT=900
elif ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here ($PYTHON's torch sees none): nothing to check" >&2
    exit 2
fi
mkdir -p "$OUT"
STAGES=${STAGES:-decode_kernel decode_step e2e host tests decode_sweep startup}
for name in $STAGES; do  # this run's stages start afresh; what another run left stays
    rm -f "$OUT/$name.log" "$OUT/$name.json"
    [ "$name" != tests ] || rm -f "$OUT/tests.xml"
done
if [ -f "$OUT/stages.txt" ]; then
    grep -v -E "^($(echo $STAGES | tr ' ' '|')) " "$OUT/stages.txt" >"$OUT/stages.txt.kept"
    mv "$OUT/stages.txt.kept" "$OUT/stages.txt"
fi

stage() {  # stage NAME LIMIT_SECONDS COMMAND...: run it, its output in OUT/NAME.log
    local name=$1 limit=$2 started=$SECONDS status
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    shift 2
    echo "gpu_check: $name (at most ${limit} s) ..." >&2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    status=$?
    echo "$name $status $((SECONDS - started))" >>"$OUT/stages.txt"
    echo "gpu_check: $name exited $status after $((SECONDS - started)) s" >&2
}

stage decode_kernel 120 "$PYTHON" benchmarks/bench_decode_kernel.py --out "$OUT"
stage decode_step 240 "$PYTHON" benchmarks/bench_decode_step.py \
    --model vkv/models/shapes/qwen3-0.6b --load-format dummy --workload nano-vllm \
    --requests 128 --max-num-seqs 128 --kv-cache-gib 16 --out "$OUT"
stage e2e 200 "$PYTHON" -m vkv.cli bench e2e --device cuda --load-format dummy \
    --model vkv/models/shapes/qwen3-0.6b --workload nano-vllm --requests 128 \
    --max-num-seqs 128 --hf-batch 128 --repeat 1 --output "$OUT/e2e.json"
stage host 150 "$PYTHON" benchmarks/bench_step_overhead.py --device cuda --gpu-path \
    --model vkv/models/shapes/qwen3-0.6b --load-format dummy --batch 128 --rounds 1 --out "$OUT"
stage tests "$TESTS_LIMIT" "$PYTHON" -m pytest tests/runtime tests/test_phase3.py \
    tests/hidden/test_phase3_hidden.py -q -n "$WORKERS" -p no:cacheprovider \
    --continue-on-collection-errors --timeout 150 --junitxml "$OUT/tests.xml"
stage decode_sweep 150 "$PYTHON" benchmarks/bench_decode_kernel.py --sweep --out "$OUT"
stage startup 30 "$PYTHON" -c '
import json, os, time
started = time.perf_counter()
from vkv import LLM
LLM()
seconds = time.perf_counter() - started
path = os.path.join(os.environ["VKV_GPU_CHECK_OUT"], "startup.json")
open(path, "w").write(json.dumps({"llm_startup_seconds": seconds}))
'

"$PYTHON" scripts/gpu_summary.py "$OUT"
