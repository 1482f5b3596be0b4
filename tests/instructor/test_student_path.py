"""A student's path through the course: the engine runs on the parts done so far.

On a student edition with Phases 1–4 solved (the student's own work, or the released reference
via ``vkv assignment solve``) and Phase 5 still stubbed, ``vkv demo`` runs with a quantized
cache and with prefix caching, without metrics, and says so in one line; with Phase 4 stubbed,
prefix caching is refused in one line naming the part.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vkv.assignment.parts import Assignment
from vkv.assignment.regions import find_regions
from vkv.assignment.release import solve, stub_tree

ROOT = Path(__file__).resolve().parents[2]

DEMO = ["demo", "--no-live", "--requests", "3", "--max-tokens", "6"]


def vkv(tree, *args: str) -> subprocess.CompletedProcess:
    """``vkv ARGS`` run on the code of ``tree``."""
    code = "import sys; from vkv.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def parts_of(phases: set[int]) -> set[str]:
    return {part.id for part in Assignment.load(ROOT).parts if part.phase in phases}


@pytest.fixture(scope="module")
def phases_1_to_4_solved(edition, tmp_path_factory):
    tree = tmp_path_factory.mktemp("student") / "edition"
    shutil.copytree(edition, tree)
    solve(ROOT, tree, parts_of({1, 2, 3, 4}))
    return tree


@pytest.mark.parametrize(
    "option", [["--kv-cache-dtype", "int8"], ["--enable-prefix-caching"]], ids=["int8", "prefix"]
)
def test_demo_runs_to_the_end_with_phase_5_stubbed(phases_1_to_4_solved, option):
    stats = (phases_1_to_4_solved / "vkv/metrics/stats.py").read_text()
    assert any(region.is_stub for region in find_regions(stats)), "Phase 5 is still stubbed"
    run = vkv(phases_1_to_4_solved, *DEMO, *option)
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"requests\s+│ 3, finished", run.stdout), run.stdout[-2000:]
    notes = [line for line in run.stderr.splitlines() if "metrics off" in line]
    assert len(notes) == 1 and notes[0].startswith("vkv: metrics off until part 5.1 ("), notes


def test_prefix_caching_before_phase_4_is_one_line_naming_the_first_unfinished_part(
    phases_1_to_4_solved,
):
    phase_4 = parts_of({4})
    stub_tree(phases_1_to_4_solved, Assignment.load(ROOT), phase_4)
    try:
        run = vkv(phases_1_to_4_solved, *DEMO, "--enable-prefix-caching")
    finally:
        solve(ROOT, phases_1_to_4_solved, phase_4)
    first = min(phase_4, key=lambda part: int(part.split(".")[1]))
    assert run.returncode == 2, run.stderr[-2000:]
    errors = run.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: part {first}: "), run.stderr[-2000:]
    assert "is not done yet, and prefix caching (--enable-prefix-caching) runs it" in errors[0]
