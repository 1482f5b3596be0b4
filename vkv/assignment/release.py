"""The student edition (``vkv assignment release``) and reference hand-outs (``solve``).

The edition is this repository's tracked files, less the instructor-only paths of
``parts.toml``, with every solution region stubbed, the student README
(``assignment/student-README.md``, where there is one) as its ``README.md``,
``edition = "student"`` in its ``parts.toml``, its tests run in one process (the reference's
``pytest -n auto`` left out of ``pyproject.toml``: a student's ``pytest -k part1 -v`` reads
test by test, in order), and the auto-grading workflows of
``assignment/workflows/`` in ``.github/workflows/``, committed as the single commit of a new
git repository: no reference code in its files, nor in its history.

The pull-request workflows (``autograde*.yml``) come in every edition; ``classroom.yml`` (GitHub
Classroom's autograding, which grades every push) only in an edition released for Classroom.
That single commit is the trusted tree ``classroom.yml`` grades each push against.
"""

import shutil
import subprocess
from pathlib import Path

from vkv.assignment.parts import MANIFEST, Assignment
from vkv.assignment.regions import RegionError, find_regions, restore_regions, stub_regions

WORKFLOWS = Path("assignment") / "workflows"
PARALLEL_TESTS = " -n auto --dist worksteal"  # in the reference's pytest addopts
STUDENT_README = Path("assignment") / "student-README.md"
CLASSROOM_WORKFLOW = "classroom.yml"


def source_files(root: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Files git tracks in ``root`` (committed or added), less ``exclude`` prefixes.

    Untracked files (scratch notes, experiments) never reach the edition: ``git add`` a new file
    before releasing or checking.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "-z"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted(
        path
        for path in listed
        if path
        and (root / path).is_file()
        and not any(path == ex or path.startswith(ex.rstrip("/") + "/") for ex in exclude)
    )


def copy_tree(root: Path, out: Path, files: list[str]) -> None:
    for path in files:
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, target)


def check_regions_only_in_editable(root: Path, assignment: Assignment, files: list[str]) -> None:
    """Raise ``RegionError`` if a file outside ``editable`` holds a solution region."""
    for path in files:
        editable = path in assignment.editable
        if path.endswith(".py") and not editable and find_regions((root / path).read_text(), path):
            raise RegionError(f"{path} holds solution regions but is not listed as editable")


def stub_tree(tree: Path, assignment: Assignment, parts: set[str]) -> None:
    """Stub the regions of ``parts`` in the editable files of ``tree``, in place."""
    for path in assignment.editable:
        file = tree / path
        file.write_text(stub_regions(file.read_text(), parts, path))


def release(root: Path, out: Path, *, commit: bool = True, classroom: bool = False) -> list[str]:
    """Write the student edition of the reference tree ``root`` into the new folder ``out``;
    with ``classroom``, with GitHub Classroom's workflow too.

    Returns the files copied from ``root`` (the workflows come on top). Raises
    ``FileExistsError`` if ``out`` exists and is not empty.
    """
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    assignment = Assignment.load(root)
    files = source_files(root, assignment.release_exclude)
    check_regions_only_in_editable(root, assignment, files)
    out.mkdir(parents=True, exist_ok=True)
    copy_tree(root, out, files)
    stub_tree(out, assignment, set(assignment.part_ids))
    if (root / STUDENT_README).is_file():
        shutil.copyfile(root / STUDENT_README, out / "README.md")
    _mark_student_edition(out / MANIFEST)
    _run_tests_in_one_process(out / "pyproject.toml")
    for workflow in sorted((root / WORKFLOWS).glob("*.yml")):
        if workflow.name == CLASSROOM_WORKFLOW and not classroom:
            continue
        target = out / ".github" / "workflows" / workflow.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(workflow, target)
    if commit:
        _commit_single(out)
    return files


def _mark_student_edition(manifest: Path) -> None:
    lines = manifest.read_text().splitlines(keepends=True)
    at = lines.index("[assignment]\n") + 1
    manifest.write_text("".join([*lines[:at], 'edition = "student"\n', *lines[at:]]))


def _run_tests_in_one_process(pyproject: Path) -> None:
    if pyproject.is_file():
        pyproject.write_text(pyproject.read_text().replace(PARALLEL_TESTS, ""))


def solve(root: Path, tree: Path, parts: set[str]) -> list[str]:
    """Put the reference code of ``parts`` into the student ``tree``; return the files changed."""
    assignment = Assignment.load(root)
    changed = []
    for path in assignment.editable:
        target = tree / path
        if not target.is_file():
            raise FileNotFoundError(f"{target} is missing: is {tree} a student edition?")
        before = target.read_text()
        after = restore_regions(before, (root / path).read_text(), parts, path)
        if after != before:
            target.write_text(after)
            changed.append(path)
    return changed


def _commit_single(out: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=out, check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    git("add", "-A")
    git(
        "-c",
        "user.name=vkv-engine",
        "-c",
        "user.email=vkv-engine@localhost",
        "commit",
        "-q",
        "-m",
        "vkv-engine: student edition",
    )
