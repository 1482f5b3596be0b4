"""``vkv grade``: score a submission part by part, without trusting it.

The submission is never run as it is. The grader copies a *trusted* tree (the course's
student edition, or this repository: tests, configuration, everything but the student's code),
overlays only the files students are meant to edit (``editable`` in ``parts.toml``), and runs
the trusted tests on it:

- one pytest process per part, in parallel, each with a timeout after which its whole process
  group is killed; plugin autoloading off, the grader's own pytest configuration, no conftest,
  no cache, no bytecode written;
- results come from the grader's plugin (``reporter.py``), which also detects a submission that
  patches pytest; the test ids are collected beforehand from the trusted tree, and a test that
  never reported (the process exited or crashed early) counts as failed;
- a file the submission changed outside ``editable`` is reported as "not graded: protected file
  modified" and ignored.

Scoring: a part's score is its points times the share of its tests that pass. A part whose
tests all fail on stubs (``NotImplementedError: part X.Y``), its own among them, is reported
"not started" rather than "failed"; a failed part whose failures all come from other parts'
stubs says which part to finish first. With
``isolate``, each part is graded again with the submission's code for that part only and the
reference's code for every other part (the solution regions make the transplant exact), so that
a bug in one part costs that part alone. Hidden tests (an instructor-only folder, ``--hidden``)
count like the others and are reported apart.

Run without ``--trusted``, the tree grades itself: a student's progress meter, not a grade.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vkv.assignment.parts import GRADED_TEST_FILE, Assignment, Part, part_of_test
from vkv.assignment.regions import RegionError, restore_regions

SKIPPED_NAMES = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}
HIDDEN_DIR = Path("tests") / "hidden"
GRADER_INI = "[pytest]\naddopts =\npython_files = test_*.py\n"
MAX_REPORT_BYTES = 64 << 20
STUB_ERROR = re.compile(r"NotImplementedError: part (\d+\.\d+):")


@dataclass(slots=True, frozen=True)
class TestOutcome:
    """One test's result: ``passed``, ``failed``, ``timeout`` or ``missing`` (never reported)."""

    nodeid: str
    outcome: str
    message: str = ""

    @property
    def part(self) -> str | None:
        return _part_of(self.nodeid)

    @property
    def hidden(self) -> bool:
        return self.nodeid.startswith(HIDDEN_DIR.as_posix() + "/")


def _part_of(nodeid: str) -> str | None:
    file, _, name = nodeid.partition("::")
    return part_of_test(Path(file).name, name)


@dataclass(slots=True, frozen=True)
class PartResult:
    """A part's tests and score; ``status`` is passed, failed, not started, timeout or error."""

    part: Part
    tests: tuple[TestOutcome, ...]
    status: str
    detail: str = ""

    @property
    def passed(self) -> int:
        return sum(test.outcome == "passed" for test in self.tests)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def score(self) -> float:
        return round(self.part.points * self.passed / self.total, 2) if self.total else 0.0


@dataclass(slots=True)
class GradeReport:
    parts: list[PartResult]
    protected_modified: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # graded file -> sha256
    isolated: list[PartResult] | None = None
    execution_time: float = 0.0

    @property
    def score(self) -> float:
        return round(sum(p.score for p in self.parts), 2)

    @property
    def max_score(self) -> float:
        return sum(p.part.points for p in self.parts)


def grade(
    submission: Path,
    trusted: Path | None = None,
    *,
    hidden: Path | None = None,
    reference: Path | None = None,
    timeout: float = 300.0,
    parts: set[str] | None = None,
) -> GradeReport:
    """Grade ``submission`` against the tests of ``trusted`` (default: itself).

    With ``reference``, also grade each part in isolation (see the module docstring). With
    ``parts``, grade only those parts (and only their phases' test files).
    """
    started = time.monotonic()
    trusted = trusted or submission
    assignment = Assignment.load(trusted)
    if parts is not None:
        assignment = assignment.restricted_to(parts)
    trusted_before = tree_digest(trusted)
    with tempfile.TemporaryDirectory(prefix="vkv-grade-", ignore_cleanup_errors=True) as scratch:
        base = Path(scratch) / "base"
        copy_clean(trusted, base)
        if hidden is not None:
            copy_clean(hidden, base / HIDDEN_DIR)
        phases = {str(part.phase) for part in assignment.parts}
        test_files = assignment.test_files + sorted(
            path.relative_to(base).as_posix()
            for path in (base / HIDDEN_DIR).glob("test_phase*.py")
            if (match := GRADED_TEST_FILE.match(path.name)) and match["phase"] in phases
        )
        ini = _ini(Path(scratch))
        ids_by_part = _collect(base, test_files, ini, assignment)

        work = Path(scratch) / "work"
        copy_clean(base, work)
        files = {}
        for path in assignment.editable:
            source = submitted_file(submission, path)
            if source is not None:
                shutil.copyfile(source, work / path)
                files[path] = hashlib.sha256(source.read_bytes()).hexdigest()
        trees = {part: work for part in ids_by_part}
        if reference is not None:
            for part in ids_by_part:
                trees[f"isolated {part}"] = _isolated_tree(
                    part, base, reference, submission, assignment, Path(scratch)
                )
        runs = _run_all(trees, ids_by_part, ini, timeout)
    if tree_digest(trusted) != trusted_before:
        raise RuntimeError(
            f"the trusted tree {trusted} changed while grading (a submission wrote to it): "
            "this grade is void; restore the tree before grading anything else"
        )
    results = {
        name: _part_result(assignment.part(name.removeprefix("isolated ")), *run)
        for name, run in runs.items()
    }
    report = GradeReport(
        parts=[results[part.id] for part in assignment.parts],
        protected_modified=protected_changes(submission, trusted, assignment),
        files=files,
        isolated=[results[f"isolated {p.id}"] for p in assignment.parts] if reference else None,
    )
    report.execution_time = round(time.monotonic() - started, 2)
    return report


def _part_result(part: Part, tests: list[TestOutcome], status: str, detail: str) -> PartResult:
    """The part's result, telling "not started" and "blocked by another part" from "wrong"."""
    failures = [test for test in tests if test.outcome != "passed"]
    stubs = [set(STUB_ERROR.findall(test.message)) for test in failures]
    if status == "failed" and all(stubs):  # every failure is some part's NotImplementedError
        own = any(part.id in found for found in stubs)
        if own and len(failures) == len(tests):
            status = "not started"
        elif not own:
            others = ", ".join(sorted(set().union(*stubs)))
            detail = f"fails on the stub of part {others}: finish that part first"
    return PartResult(part, tuple(tests), status, detail)


def submitted_file(submission: Path, path: str) -> Path | None:
    """The submission's file at ``path``, or None if it is missing or reached through a link."""
    file = submission / path
    if not file.is_file() or file.resolve() != submission.resolve() / path:
        return None
    return file


def protected_changes(submission: Path, trusted: Path, assignment: Assignment) -> list[str]:
    """Files of the submission, outside ``editable``, that are new or differ from ``trusted``,
    and every symbolic link in it (never followed)."""
    if submission.resolve() == trusted.resolve():
        return []
    ours = tree_files(trusted)
    changed = [f"{link} (symbolic link)" for link in symbolic_links(submission)]
    for path, file in tree_files(submission).items():
        if path in assignment.editable:
            continue
        original = ours.get(path)
        if original is None or original.read_bytes() != file.read_bytes():
            changed.append(path)
    return changed


def tree_files(root: Path) -> dict[str, Path]:
    """Every file under ``root`` by relative path, less version control, caches, venvs and
    symbolic links (a submitted link could point anywhere)."""
    found = {}
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_NAMES)
        for name in names:
            path = Path(directory) / name
            if not name.endswith(".pyc") and not path.is_symlink():
                found[path.relative_to(root).as_posix()] = path
    return found


def symbolic_links(root: Path) -> list[str]:
    """Every symbolic link under ``root`` (to a file or a folder), by relative path."""
    links = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_NAMES]
        for name in subdirs + names:
            path = Path(directory) / name
            if path.is_symlink():
                links.append(path.relative_to(root).as_posix())
    return sorted(links)


def tree_digest(root: Path) -> str:
    """A digest of every file's path and content under ``root`` (caches and venvs left out)."""
    digest = hashlib.sha256()
    for path, file in sorted(tree_files(root).items()):
        digest.update(path.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def copy_clean(source: Path, target: Path) -> None:
    for path, file in tree_files(source).items():
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target / path)


def _isolated_tree(
    part: str,
    base: Path,
    reference: Path,
    submission: Path,
    assignment: Assignment,
    scratch: Path,
) -> Path | RegionError:
    """The reference's code with the submission's regions of ``part`` transplanted in."""
    tree = scratch / f"isolated-{part}"
    copy_clean(base, tree)
    for path in assignment.editable:
        ours = (reference / path).read_text()
        theirs = submission / path
        try:
            text = (
                restore_regions(ours, theirs.read_text(), {part}, path)
                if theirs.is_file()
                else ours
            )
        except RegionError as exc:
            return exc
        (tree / path).write_text(text)
    return tree


def _pytest(files_or_ids: list[str], ini: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        "--rootdir",
        ".",
        "--noconftest",
        "-p",
        "no:cacheprovider",
        "-q",
        *extra,
        *files_or_ids,
    ]


def _environment(tree: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VKV_"))}
    return env | {
        "PYTHONPATH": str(tree),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "VKV_HYPOTHESIS_SHRINK": "0",
        **extra,
    }


def _ini(scratch: Path) -> Path:
    """The grader's own pytest configuration, written once per grade."""
    ini = scratch / "grader.ini"
    ini.write_text(GRADER_INI)
    return ini


def _collect(
    base: Path, files: list[str], ini: Path, assignment: Assignment
) -> dict[str, list[str]]:
    """The graded test ids of the trusted tree, by part (collection imports trusted code only)."""
    done = subprocess.run(
        _pytest(files, ini, "--collect-only"),
        cwd=base,
        env=_environment(base),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        raise RuntimeError(f"collecting the trusted tests failed:\n{done.stdout[-2000:]}")
    by_part: dict[str, list[str]] = {part: [] for part in assignment.part_ids}
    for nodeid in ids:
        part = _part_of(nodeid)
        if part in by_part:
            by_part[part].append(nodeid)
    return by_part


RunResult = tuple[list[TestOutcome], str, str]


def _run_all(
    trees: dict[str, Path | RegionError],
    ids_by_part: dict[str, list[str]],
    ini: Path,
    timeout: float,
) -> dict[str, RunResult]:
    """Run every tree's part in parallel: outcomes, status and detail by tree name."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {
            name: pool.submit(
                _run_part,
                tree,
                ids_by_part[name.removeprefix("isolated ")],
                ini,
                ini.parent / f"report-{name.replace(' ', '-')}.jsonl",
                timeout,
            )
            for name, tree in trees.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _run_part(
    tree: Path | RegionError, ids: list[str], ini: Path, report: Path, timeout: float
) -> RunResult:
    """Run the tests ``ids`` in ``tree``: outcomes, status and a detail for the report."""
    if isinstance(tree, RegionError):
        return [TestOutcome(i, "failed", str(tree)) for i in ids], "error", str(tree)
    if not ids:
        return [], "error", "no tests"
    process = subprocess.Popen(
        _pytest(ids, ini, "-p", "vkv.assignment.reporter"),
        cwd=tree,
        env=_environment(tree, VKV_GRADE_REPORT=str(report)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    timed_out = False
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        timed_out = True
    return _read_report(report, ids, timed_out, timeout)


def _records(report: Path) -> list[dict]:
    """The report's JSON objects; anything else (a bad line, a huge file) is skipped."""
    if not report.is_file() or report.is_symlink():
        return []
    with report.open("rb") as file:
        data = file.read(MAX_REPORT_BYTES)
    records = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read_report(report: Path, ids: list[str], timed_out: bool, timeout: float) -> RunResult:
    """Each test's outcome from the reporter's lines; unreported tests count as failed."""
    phases: dict[str, list[dict]] = {}
    finished, tampered = False, None
    wanted = set(ids)
    for record in _records(report):
        if record.get("event") == "finished":
            finished, tampered = True, record.get("tampered")
            break
        if record.get("nodeid") in wanted and isinstance(record.get("message", ""), str):
            phases.setdefault(record["nodeid"], []).append(record)
    unreported = "timeout" if timed_out else "missing"
    outcomes = []
    for nodeid in ids:
        records = phases.get(nodeid, [])
        failed = [r for r in records if r.get("outcome") == "failed"]
        called = any(r.get("when") == "call" and r.get("outcome") == "passed" for r in records)
        if tampered or failed:
            message = (
                f"pytest was tampered with: {tampered}"
                if tampered
                else failed[0].get("message", "")
            )
            outcomes.append(TestOutcome(nodeid, "failed", message))
        elif called:
            outcomes.append(TestOutcome(nodeid, "passed"))
        else:
            outcomes.append(TestOutcome(nodeid, unreported, "never reported"))
    if timed_out:
        return outcomes, "timeout", f"killed after {timeout:.0f} s"
    if tampered:
        return outcomes, "error", f"pytest was tampered with ({tampered})"
    if not finished:
        return outcomes, "error", "the test process ended before the session finished"
    passed = all(o.outcome == "passed" for o in outcomes)
    return outcomes, "passed" if passed else "failed", ""
