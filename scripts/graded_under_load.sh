#!/usr/bin/env bash
# The graded suites, visible and hidden, run again and again on the reference while busy loops
# load every core: the check behind "no graded test fails correct code on a busy machine"
# (DESIGN.md). Each run draws fresh hidden-test seeds; each prints its load average, its time
# and pytest's summary line. Exit status 1 if any run failed.
#
#   bash scripts/graded_under_load.sh                     Phases 1-5, 10 runs, 4 loops a core
#   RUNS=3 LOOPS_PER_CORE=2 bash scripts/graded_under_load.sh 3 4 5     some phases
#
# Run it in a clone you are not editing: the runs read the tree as it is at each start.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(1 2 3 4 5)
runs="${RUNS:-10}"
loops=$(( ${LOOPS_PER_CORE:-4} * $(nproc) ))

tests=()
for phase in "${phases[@]}"; do
    tests+=("tests/test_phase${phase}.py")
    [ -f "tests/hidden/test_phase${phase}_hidden.py" ] && tests+=("tests/hidden/test_phase${phase}_hidden.py")
done

busy=()
for _ in $(seq "$loops"); do (while :; do :; done) & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT

failed=0
for run in $(seq "$runs"); do
    start=$(date +%s)
    load=$(cut -d' ' -f1 /proc/loadavg)
    if summary=$(uv run --frozen pytest "${tests[@]}" -q -p no:cacheprovider 2>&1 | tail -1) \
        && [[ "$summary" != *failed* && "$summary" != *error* ]]; then
        status=ok
    else
        status=FAILED
        failed=1
    fi
    echo "run $run/$runs ($status): load $load at start, $(cut -d' ' -f1 /proc/loadavg) at end," \
        "$(( $(date +%s) - start )) s: $summary"
done
exit "$failed"
