#!/usr/bin/env bash
# Mutation testing of the graded modules with mutmut 3 (a dev dependency: run `uv sync`).
#
#   bash scripts/mutation.sh                  fresh run (3 minutes on 2 idle cores)
#   bash scripts/mutation.sh --resume         finish an interrupted run (checks only the
#                                             mutants not yet checked)
#   bash scripts/mutation.sh mutmut ARGS...   any mutmut command on the last run, e.g.
#                                             `mutmut results`, `mutmut show NAME`
#
# [tool.mutmut] in pyproject.toml says what is mutated (vkv/engine/{sequence,block,evictor,
# block_manager,swapper,scheduler,quantizer,radix_cache,key_residual,prefix_caching}.py,
# vkv/kernels/quantized.py, vkv/metrics/{stats,rules}.py) and which tests run
# (tests/test_phase{1,2,3,4,5}.py and tests/hidden/test_phase{1,3,4,5}_hidden.py; never
# tests/runtime or tests/instructor). Phase 5's rule tests need promtool (Debian: apt-get
# install prometheus): without it they would be skipped and every rules.py mutant survive, so
# VKV_REQUIRE_PROMETHEUS=1 makes them fail instead.
#
# mutmut runs in a staging copy, build/mutation/ (vkv/, tests/, pyproject.toml), never in the
# working tree: mutmut 3 does not mutate decorated functions, so in the staging copy each
# `@property` line of the graded modules becomes a comment and the file ends with
# `Class.name = property(Class.name)` (same line numbers, same behaviour), which lets mutmut
# mutate the property bodies too. mutmut then copies the staging copy into
# build/mutation/mutants/ and runs pytest there, forking one child per mutant.
#
# Environment: MUTMUT_MAX_CHILDREN (parallel workers, default 2),
#              VKV_HYPOTHESIS_SHRINK (default 0: Hypothesis does not shrink a failure),
#              VKV_GRADE_SEED (default 20261202: the hidden tests draw the same cases for the
#                clean run and every mutant),
#              OMP_NUM_THREADS (default 1: mutmut's timeout is in CPU seconds, scaled from the
#                clean run's wall time, and torch's extra threads spend CPU seconds faster),
#              VKV_REQUIRE_PROMETHEUS (default 1: Phase 5's rule tests fail without promtool).
#              MUTATION_MODULES, MUTATION_TESTS (space-separated paths: mutate only these modules,
#                run only these test files; default: [tool.mutmut]'s lists), e.g.
#                MUTATION_MODULES=vkv/engine/key_residual.py MUTATION_TESTS="tests/test_phase3.py
#                tests/hidden/test_phase3_hidden.py" bash scripts/mutation.sh
#              MUTMUT_TIMEOUT_MULTIPLIER (mutmut's timeout_multiplier; mutmut's default 15).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
stage="$root/build/mutation"
cd "$root"

export VKV_HYPOTHESIS_SHRINK="${VKV_HYPOTHESIS_SHRINK:-0}"
export VKV_GRADE_SEED="${VKV_GRADE_SEED:-20261202}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export VKV_REQUIRE_PROMETHEUS="${VKV_REQUIRE_PROMETHEUS:-1}"
max_children="${MUTMUT_MAX_CHILDREN:-2}"

mutmut() {
    # uv's project is the repository (the staging copy has a pyproject.toml of its own);
    # mutmut reads [tool.mutmut] from the current directory: the staging copy.
    (cd "$stage" && uv run --project "$root" -- mutmut "$@")
}

resume=0
case "${1:-}" in
    "") ;;
    --resume) resume=1 ;;
    mutmut)
        shift
        [[ -d "$stage/mutants" ]] || { echo "no run in $stage: run this script first" >&2; exit 1; }
        mutmut "$@"
        exit
        ;;
    -h | --help) sed -n '2,37p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

modules="${MUTATION_MODULES:-$(uv run --project "$root" -- python -c '
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]["only_mutate"]))')}"

start=$(date +%s)
if [[ $resume -eq 0 || ! -d "$stage" ]]; then
    rm -rf "$stage"
    mkdir -p "$stage"
    cp -R vkv tests assignment scripts pyproject.toml "$stage"/
    find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
    # A subset (MUTATION_MODULES, MUTATION_TESTS) or another timeout: the staging copy's
    # [tool.mutmut] says so; the repository's pyproject.toml is left as it is.
    (cd "$stage" && uv run --project "$root" -- python - "$modules" "${MUTATION_TESTS:-}" \
        "${MUTMUT_TIMEOUT_MULTIPLIER:-}") <<'PY'
import re
import sys
from pathlib import Path

modules, tests, multiplier = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3]
path = Path("pyproject.toml")
text = path.read_text()
text = re.sub(r"only_mutate = \[.*?\]", f"only_mutate = {modules!r}".replace("'", '"'), text, flags=re.S)
if tests:
    selection = f"pytest_add_cli_args_test_selection = {tests!r}".replace("'", '"')
    text = re.sub(r"pytest_add_cli_args_test_selection = \[.*?\]", selection, text, flags=re.S)
if multiplier:
    text = text.replace("[tool.mutmut]\n", f"[tool.mutmut]\ntimeout_multiplier = {float(multiplier)}\n", 1)
path.write_text(text)
PY
    # shellcheck disable=SC2086  # one word per module
    (cd "$stage" && uv run --project "$root" -- python - $modules) <<'PY'
"""Move each class's @property decorators to the end of its module: `Class.name = property(Class.name)`."""
import ast
import sys
from pathlib import Path

for name in sys.argv[1:]:
    path = Path(name)
    lines = path.read_text().splitlines(keepends=True)
    moved = []
    for cls in ast.parse("".join(lines)).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.FunctionDef) and len(node.decorator_list) == 1):
                continue
            decorator = node.decorator_list[0]
            if not (isinstance(decorator, ast.Name) and decorator.id == "property"):
                continue
            i = decorator.lineno - 1
            assert lines[i].strip() == "@property", f"{path}:{i + 1}: {lines[i]!r}"
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i] = f"{indent}# @property: moved to the end of the file by scripts/mutation.sh\n"
            moved.append(f"{cls.name}.{node.name}")
    if moved:
        lines.append("\n\n# scripts/mutation.sh moved these @property decorators here: mutmut 3 mutates\n")
        lines.append("# the bodies of undecorated methods only.\n")
        lines += [f"{m} = property({m})\n" for m in moved]
        path.write_text("".join(lines))
    print(f"staged {path}: {len(moved)} @property bodies made mutable")
PY
fi

# mutmut exits non-zero when the clean test run fails or the setup is broken; survivors are
# not an error. Its progress line redraws itself: the log keeps every redraw.
status=0
mutmut run --max-children "$max_children" 2>&1 | tee "$stage/mutation-run.log" || status=$?
end=$(date +%s)
if [[ $status -ne 0 ]]; then
    echo "mutmut run failed (exit $status); see $stage/mutation-run.log" >&2
    exit "$status"
fi

# shellcheck disable=SC2086
(cd "$stage" && uv run --project "$root" -- python - "$((end - start))" $modules) <<'PY'
import json
import sys
from pathlib import Path

from mutmut.stats import status_by_exit_code

COLUMNS = ("total", "killed", "survived", "timeout/susp", "no tests", "skipped", "unchecked")


def row_for(exit_codes):
    count = [status_by_exit_code[code] for code in exit_codes].count
    return {
        "total": len(exit_codes),
        "killed": count("killed") + count("caught by type check"),
        "survived": count("survived"),
        "timeout/susp": count("timeout") + count("suspicious") + count("segfault"),
        "no tests": count("no tests"),
        "skipped": count("skipped"),
        "unchecked": count("not checked") + count("check was interrupted by user"),
    }


def score(row):
    denominator = row["total"] - row["skipped"]
    return f"{100 * row['killed'] / denominator:6.1f}%" if denominator else "     -"


seconds, modules = int(sys.argv[1]), sys.argv[2:]
rows, every_code = {}, []
for module in modules:
    meta = Path("mutants") / (module + ".meta")
    codes = list(json.loads(meta.read_text())["exit_code_by_key"].values()) if meta.exists() else []
    every_code += codes
    rows[module] = row_for(codes)
rows["TOTAL"] = row_for(every_code)

width = max(map(len, rows))
header = f"{'module':<{width}}" + "".join(f"{c:>14}" for c in COLUMNS) + "     score"
print("\nMutation score = killed / (total - skipped)\n")
print(header)
print("-" * len(header))
for module, row in rows.items():
    print(f"{module:<{width}}" + "".join(f"{row[c]:>14}" for c in COLUMNS) + f"   {score(row)}")
print(f"\nwall time (staging + mutmut run): {seconds // 60} min {seconds % 60} s")
print("survivors: bash scripts/mutation.sh mutmut results; a diff: bash scripts/mutation.sh mutmut show NAME")
PY
