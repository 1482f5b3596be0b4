"""The student edition, solve and grade on the real repository (instructor tooling)."""

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from vkv.assignment.grade import grade
from vkv.assignment.parts import Assignment
from vkv.assignment.regions import find_regions
from vkv.assignment.release import PARALLEL_TESTS, release, solve
from vkv.cli import main

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = Assignment.load(ROOT)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("edition")
    release(ROOT, out)
    return out


def test_edition_stubs_every_region_and_leaves_out_instructor_files(edition):
    for path in ASSIGNMENT.editable:
        regions = find_regions((edition / path).read_text(), path)
        assert regions and all(r.is_stub for r in regions), f"{path} has an unstubbed region"
    for excluded in ASSIGNMENT.release_exclude:
        assert not (edition / excluded).exists(), f"{excluded} is instructor-only"
    for needed in ("README.md", "pyproject.toml", "uv.lock", "assignment/phase1.md"):
        assert (edition / needed).is_file(), f"the edition is a complete project: {needed}"
    workflows = sorted(p.name for p in (edition / ".github/workflows").glob("*.yml"))
    assert workflows == ["autograde-comment.yml", "autograde.yml"], workflows


def test_edition_has_the_student_readme_and_says_it_is_the_student_edition(edition):
    readme = (edition / "README.md").read_text()
    assert readme == (ROOT / "assignment/student-README.md").read_text()
    assert "--trusted" not in readme and "For instructors" not in readme, "no grader internals"
    assert Assignment.load(edition).edition == "student"
    assert Assignment.load(ROOT).edition == "reference"


def test_the_edition_runs_its_tests_in_one_process_and_the_reference_on_every_core(edition):
    """A student's ``pytest -k part1 -v`` reads test by test, in order; the reference's whole
    suite spreads over the cores (pytest-xdist)."""
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    theirs = tomllib.loads((edition / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "-n auto" in ours["addopts"]
    assert theirs["ini_options"]["addopts"] == ours["addopts"].replace(PARALLEL_TESTS, "")
    assert "-n" not in theirs["ini_options"]["addopts"].split()


@pytest.mark.parametrize(
    "argv",
    [
        ["grade", "{edition}", "--isolate"],
        ["assignment", "check"],
        ["assignment", "solve", "{edition}", "--parts", "1.1"],
        ["assignment", "release", "{out}"],
    ],
)
def test_the_edition_refuses_what_needs_the_reference(edition, tmp_path, argv, capsys):
    args = [a.format(edition=edition, out=tmp_path / "out") for a in argv]
    assert main([*args, "--root", str(edition)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "is a student edition" in said and "pass --root" in said, said
    assert not (tmp_path / "out").exists()


def test_edition_is_a_fresh_repository_with_one_commit(edition):
    count = subprocess.run(
        ["git", "rev-list", "--count", "HEAD"], cwd=edition, capture_output=True, text=True
    )
    assert count.stdout.strip() == "1"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=edition, capture_output=True)
    assert status.stdout == b"", "everything in the edition is committed"


def test_release_refuses_a_folder_that_is_not_empty(edition):
    with pytest.raises(FileExistsError):
        release(ROOT, edition)


def test_grade_scores_zero_on_the_edition_and_per_part_after_solve(tmp_path):
    out = tmp_path / "student"
    release(ROOT, out, commit=False)
    fresh = grade(out, parts={"1.1", "1.3"}).parts
    assert all(score.score == 0 for score in fresh), "the stubs earn no points"
    assert [score.status for score in fresh] == ["not started", "not started"]
    solve(ROOT, out, {"1.1", "1.2"})
    # Phases 1 and 2: Phase 3's kernels, interpreted on a CPU, would add a minute and no new kind
    # of line (whole grades run in test_gradescope.py and test_workflows_act.py)
    document, lines = _grade_piped(out, "1,2")
    scores = {s["id"]: s for s in document["parts"]}
    assert scores["1.1"]["score"] == scores["1.1"]["max_score"]
    assert scores["1.2"]["score"] == scores["1.2"]["max_score"]
    assert scores["1.5"]["status"] == "not started"
    assert scores["1.5"]["score"] < scores["1.5"]["max_score"]
    assert scores["2.1"]["status"] == "failed" and "part 1.3" in scores["2.1"]["detail"], (
        "2.1's tests fail on 1.3's stub: the report says to finish part 1.3 first"
    )
    graded = [part for part in ASSIGNMENT.parts if part.id.split(".")[0] in ("1", "2")]
    assert document["max_score"] == sum(p.points for p in graded)
    assert document["score"] == pytest.approx(sum(s["score"] for s in scores.values()))
    said = [line.split()[1] for _, line in lines if line.startswith("part ")]
    assert sorted(said) == sorted(p.id for p in graded), "a line a part, each part once"
    full = f"{scores['1.1']['max_score']:g}/{scores['1.1']['max_score']:g}"
    assert full in next(line for _, line in lines if line.startswith("part 1.1 ")), lines
    first, last = lines[0][0], lines[-1][0]
    assert first < last / 2, f"lines come as parts end, not all at once ({first:.0f}/{last:.0f} s)"


def _grade_piped(tree: Path, parts: str) -> tuple[dict, list[tuple[float, str]]]:
    """``vkv grade --parts PARTS --format json`` of ``tree`` on pipes: the document, and each
    line of stderr with the seconds after the start at which it came."""
    started = time.monotonic()
    with (tree.parent / "grade.json").open("w+") as document:
        process = subprocess.Popen(
            [
                Path(sys.executable).with_name("vkv"),
                "grade",
                str(tree),
                "--parts",
                parts,
                "--format",
                "json",
            ],
            stdout=document,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = [(time.monotonic() - started, line.rstrip("\n")) for line in process.stderr]
        assert process.wait() == 0, lines
        document.seek(0)
        return json.load(document), lines


def test_solve_all_restores_the_reference_files(tmp_path):
    out = tmp_path / "student"
    release(ROOT, out, commit=False)
    solve(ROOT, out, set(ASSIGNMENT.part_ids))
    for path in ASSIGNMENT.editable:
        assert (out / path).read_text() == (ROOT / path).read_text()


def test_parts_manifest_is_consistent():
    assert ASSIGNMENT.expand("1") == {"1.1", "1.2", "1.3", "1.4", "1.5"}
    assert ASSIGNMENT.expand("1.2,1.4") == {"1.2", "1.4"}
    assert ASSIGNMENT.dependents("1.2") >= {"1.3", "1.4", "1.5", "2.1", "2.5"}
    assert ASSIGNMENT.dependents("1.4") == {"2.4", "2.5", "4.8", "4.9"}  # Phase 4 builds on 1-2
    assert ASSIGNMENT.dependents("2.4") == {"2.5", "4.9"}
    assert ASSIGNMENT.dependents("2.5") == {"4.9"}
    with pytest.raises(KeyError):
        ASSIGNMENT.expand("9.9")


def test_isolate_blames_the_part_whose_region_is_wrong(tmp_path):
    """The review's case: the victim is chosen in 2.2's region; with --isolate 2.2 must lose."""
    out = tmp_path / "student"
    release(ROOT, out, commit=False)
    solve(ROOT, out, set(ASSIGNMENT.part_ids))
    scheduler = out / "vkv/engine/scheduler.py"
    text = scheduler.read_text()
    wrong = "victims = [queue.popleft()] if queue else [seq]"
    right = "victims = self._pop_newest_group(queue) if queue else [seq]"
    scheduler.write_text(text.replace(right, wrong))
    assert wrong in scheduler.read_text()
    result = grade(out, reference=ROOT, parts={"2.2", "2.3"})
    alone = {r.part.id: r for r in result.isolated}
    assert alone["2.2"].score < alone["2.2"].part.points, "2.2's own tests see the wrong victim"
    assert alone["2.3"].score == alone["2.3"].part.points, (
        "graded alone, part 2.3 (correct) runs with the reference 2.2 and keeps its points"
    )


def test_the_student_readme_says_which_files_k_part3_selects(edition):
    """The README's claim about ``-k part3`` without a file, checked by collecting."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-k", "part3"],
        cwd=edition,
        env={**os.environ, "PYTHONPATH": str(edition)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    files = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    assert files == {f"tests/test_phase{phase}.py" for phase in range(1, 6)}, run.stdout[-2000:]
    readme = " ".join((edition / "README.md").read_text().split())
    assert "from all five files `tests/test_phase1.py` … `tests/test_phase5.py`" in readme
