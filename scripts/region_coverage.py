"""Branch coverage of the solution regions by the graded tests, part by part.

The standard every graded part meets (DESIGN.md) asks that the graded tests of a phase run every
line and take every branch of its solution regions: code that no graded test reaches is code a
student can get wrong for free. This runs a phase's graded tests, visible and hidden, under
coverage.py with branch coverage (pytest-cov), then keeps what lies inside the regions of that
phase (``vkv/assignment/regions.py`` finds them) and prints, per part, the statements and the
branches covered, and the lines of any not covered.

    uv run python scripts/region_coverage.py [--phases 3,4,5] [--seed 20261202]

The hidden tests draw their inputs from ``VKV_GRADE_SEED`` (``--seed``). Part 3.8's Triton
region is measured too: on a CPU the Triton interpreter runs it as Python, line by line. Exit
status 1 if any part misses a line or a branch, or a graded test fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.assignment.parts import Assignment
from vkv.assignment.regions import find_regions

ROOT = Path(__file__).resolve().parents[1]


def region_lines(assignment: Assignment) -> dict[str, dict[str, set[int]]]:
    """For each editable file, each part's region lines (1-based, the markers left out)."""
    lines: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for name in assignment.editable:
        text = (ROOT / name).read_text()
        for region in find_regions(text, name):
            lines[name][region.part].update(range(region.begin + 2, region.end + 1))
    return lines


def run_tests(phases: list[int], seed: str, report: Path) -> int:
    """The phases' graded tests under branch coverage; pytest's exit status."""
    tests = []
    for phase in phases:
        tests.append(f"tests/test_phase{phase}.py")
        hidden = ROOT / f"tests/hidden/test_phase{phase}_hidden.py"
        if hidden.exists():
            tests.append(str(hidden.relative_to(ROOT)))
    command = [
        sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider",
        "--cov=vkv", "--cov-branch", f"--cov-report=json:{report}", "--cov-report=",
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "VKV_GRADE_SEED": seed}).returncode


def part_coverage(data: dict, lines: dict[str, dict[str, set[int]]], phases: list[int]) -> list:
    """Rows of (part, statements covered, statements, branches covered, branches, missed)."""
    rows = []
    for name, parts in lines.items():
        measured = data["files"].get(name, {})
        executed = set(measured.get("executed_lines", []))
        missing = set(measured.get("missing_lines", []))
        taken = [tuple(b) for b in measured.get("executed_branches", [])]
        not_taken = [tuple(b) for b in measured.get("missing_branches", [])]
        for part, region in parts.items():
            if int(part.split(".")[0]) not in phases:
                continue
            statements = region & (executed | missing)
            covered = region & executed
            branches = [b for b in taken + not_taken if b[0] in region]
            missed_branches = [b for b in not_taken if b[0] in region]
            missed = sorted(region & missing)
            missed_text = ", ".join(
                [f"line {n}" for n in missed] + [f"branch {a}->{b}" for a, b in missed_branches]
            )
            rows.append(
                (
                    part,
                    name,
                    len(covered),
                    len(statements),
                    len(branches) - len(missed_branches),
                    len(branches),
                    missed_text,
                )
            )
    return sorted(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="1,2,3,4,5", help="comma-separated phases")
    parser.add_argument("--seed", default="20261202", help="VKV_GRADE_SEED of the hidden tests")
    args = parser.parse_args()
    phases = [int(p) for p in args.phases.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "coverage.json"
        status = run_tests(phases, args.seed, report)
        data = json.loads(report.read_text())
    rows = part_coverage(data, region_lines(Assignment.load(ROOT)), phases)
    table = Table(title=f"solution regions covered by the graded tests (seed {args.seed})")
    for column in ("part", "file", "statements", "branches", "not covered"):
        table.add_column(column)
    gaps = False
    for part, name, covered, statements, taken, branches, missed in rows:
        gaps |= bool(missed)
        table.add_row(part, name, f"{covered}/{statements}", f"{taken}/{branches}", missed)
    Console(width=160).print(table)
    if status:
        print(f"pytest exited with {status}: a graded test failed on the reference")
    return 1 if gaps or status else 0


if __name__ == "__main__":
    sys.exit(main())
