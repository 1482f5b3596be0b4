#!/usr/bin/env bash
# Mutation testing of the six graded modules with mutmut 3 (a dev dependency: `uv sync`).
#
#   bash scripts/mutation.sh            fresh run: deletes mutants/ first
#   bash scripts/mutation.sh --resume   keeps mutants/ and checks only the mutants not yet checked
#
# What is mutated and which tests run is configured in [tool.mutmut] in pyproject.toml: the
# modules vkv/engine/{sequence,block,evictor,block_manager,swapper,scheduler}.py, and only the
# graded tests (tests/test_phase1.py, tests/test_phase2.py, tests/hidden/test_phase1_hidden.py).
# mutmut copies vkv/ and tests/ into mutants/ and runs pytest there, in-process, forking one
# child per mutant. Afterwards: `uv run mutmut results` lists the survivors,
# `uv run mutmut show NAME` prints one mutant's diff.
#
# Environment: MUTMUT_MAX_CHILDREN (parallel workers, default 2),
#              VKV_HYPOTHESIS_SHRINK (default 0: Hypothesis does not shrink failures).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

resume=0
for arg in "$@"; do
    case "$arg" in
        --resume) resume=1 ;;
        -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

export VKV_HYPOTHESIS_SHRINK="${VKV_HYPOTHESIS_SHRINK:-0}"
max_children="${MUTMUT_MAX_CHILDREN:-2}"

if [[ $resume -eq 0 ]]; then
    rm -rf mutants
fi
mkdir -p mutants

start=$(date +%s)
# mutmut exits non-zero when the clean test run fails or the setup is broken; survivors are
# not an error. Its progress line redraws itself: the log keeps every redraw.
status=0
uv run mutmut run --max-children "$max_children" 2>&1 | tee mutants/mutation-run.log || status=$?
end=$(date +%s)
if [[ $status -ne 0 ]]; then
    echo "mutmut run failed (exit $status); see mutants/mutation-run.log" >&2
    exit "$status"
fi

uv run python - "$((end - start))" <<'PY'
import json
import sys
from pathlib import Path

from mutmut.stats import status_by_exit_code

MODULES = [
    "vkv/engine/sequence.py",
    "vkv/engine/block.py",
    "vkv/engine/evictor.py",
    "vkv/engine/block_manager.py",
    "vkv/engine/swapper.py",
    "vkv/engine/scheduler.py",
]
COLUMNS = ("total", "killed", "survived", "timeout/susp", "no tests", "skipped", "unchecked")


def row_for(exit_codes):
    statuses = [status_by_exit_code[code] for code in exit_codes]
    count = statuses.count
    row = {
        "total": len(statuses),
        "killed": count("killed") + count("caught by type check"),
        "survived": count("survived"),
        "timeout/susp": count("timeout") + count("suspicious") + count("segfault"),
        "no tests": count("no tests"),
        "skipped": count("skipped"),
        "unchecked": count("not checked") + count("check was interrupted by user"),
    }
    return row


def score(row):
    denominator = row["total"] - row["skipped"]
    return f"{100 * row['killed'] / denominator:6.1f}%" if denominator else "     -"


rows, every_code = {}, []
for module in MODULES:
    meta = Path("mutants") / (module + ".meta")
    codes = list(json.loads(meta.read_text())["exit_code_by_key"].values()) if meta.exists() else []
    every_code += codes
    rows[module] = row_for(codes)

width = max(map(len, MODULES))
header = f"{'module':<{width}}  " + "  ".join(f"{c:>12}" for c in COLUMNS) + "    score"
print()
print("Mutation score = killed / (total - skipped)")
print(header)
print("-" * len(header))
for module, row in [*rows.items(), ("TOTAL", row_for(every_code))]:
    print(f"{module:<{width}}  " + "  ".join(f"{row[c]:>12}" for c in COLUMNS) + f"  {score(row)}")
seconds = int(sys.argv[1])
print(f"\nwall time: {seconds // 60} min {seconds % 60} s")
PY
