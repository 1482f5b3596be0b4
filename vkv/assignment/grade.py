"""``vkv grade``: score a submission part by part, without trusting it.

The submission is never run as it is. The grader copies a *trusted* tree (the course's
student edition, or this repository: tests, configuration, everything but the student's code),
overlays only the files students are meant to edit (``editable`` in ``parts.toml``), and runs
the trusted tests on it:

- one pytest process per part (and one more for its hidden tests), in parallel, each with a
  timeout after which its whole process group is killed; plugin autoloading off, the grader's
  own pytest configuration, no conftest, no cache, no bytecode written;
- results come from the grader's plugin (``reporter.py``), which also detects a submission that
  patches pytest; the test ids are collected beforehand from the trusted tree, and a test that
  never reported (the process exited or crashed early) counts as failed;
- a file the submission changed outside ``editable`` is reported as "not graded: protected file
  modified" and ignored;
- an editable file that breaks the static policy (``policy.py``: code outside the solution
  regions, forbidden imports and names...) is not graded: the edition's copy stays, and the
  parts with a region in it score 0, "not graded" with the rule and its line;
- each test process starts from a clean interpreter (no editable install, no project root on
  its path) and, where bubblewrap works, inside an OS sandbox that sees only its own tree
  (``sandbox.py``); a part's hidden tests run in a process of their own, so no visible test's
  output can carry them; nothing a test process started outlives it.

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

import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from vkv.assignment import sandbox
from vkv.assignment.parts import GRADED_TEST_FILE, Assignment, Part, part_of_test
from vkv.assignment.policy import Violation, check_file
from vkv.assignment.regions import RegionError, find_regions, restore_regions

SKIPPED_NAMES = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}
HIDDEN_DIR = Path("tests") / "hidden"
GRADER_INI = "[pytest]\naddopts =\npython_files = test_*.py\n"
GRADER_INI_NAME = "vkv-grader.ini"
MAX_REPORT_BYTES = 64 << 20
PIPE_GRACE = 1.0  # seconds to drain the report after the test process exited
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


RunResult = tuple[list[TestOutcome], str, str]  # one test process: outcomes, status, detail


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
    not_graded: dict[str, str] = field(default_factory=dict)  # file -> the policy's reason
    isolated: list[PartResult] | None = None
    sandboxed: bool = False
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
    require_sandbox: bool = False,
    enforce_policy: bool = True,
) -> GradeReport:
    """Grade ``submission`` against the tests of ``trusted`` (default: itself).

    With ``reference``, also grade each part in isolation (see the module docstring). With
    ``parts``, grade only those parts (and only their phases' test files). With
    ``require_sandbox``, raise ``RuntimeError`` rather than grade without bubblewrap.
    ``enforce_policy=False`` (not offered by the CLI) lets code the policy would refuse run, so
    that the layers behind the policy (the sandbox, the guard) can be tested on their own.
    """
    started = time.monotonic()
    sandboxed = sandbox.available()
    if require_sandbox and not sandboxed:
        raise RuntimeError(f"no sandbox to grade in: {sandbox.why_unavailable()}")
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
        (base / GRADER_INI_NAME).write_text(GRADER_INI)
        ids_by_part = _collect(base, _test_files(base, assignment), assignment)
        submitted, not_graded, files = check_submission(
            submission, base, assignment, enforce_policy
        )
        runs = _plan(Path(scratch), base, ids_by_part, submitted, reference, assignment)
        done = _run_all([run for run in runs if run.part not in not_graded], timeout, sandboxed)
    if tree_digest(trusted) != trusted_before:
        raise RuntimeError(
            f"the trusted tree {trusted} changed while grading (a submission wrote to it): "
            "this grade is void; restore the tree before grading anything else"
        )

    def result(part: Part, isolated: bool) -> PartResult:
        ids = ids_by_part[part.id]
        if part.id in not_graded:
            reason = str(not_graded[part.id])
            failed = tuple(TestOutcome(i, "failed", reason) for i in ids)
            return PartResult(part, failed, "not graded", reason)
        if not ids:
            return PartResult(part, (), "error", "no tests")
        own = [done[run] for run in runs if run.part == part.id and run.isolated is isolated]
        return _part_result(part, *_combine(own))

    report = GradeReport(
        parts=[result(part, False) for part in assignment.parts],
        protected_modified=protected_changes(submission, trusted, assignment),
        files=files,
        not_graded={str(v.path): str(v) for v in not_graded.values()},
        isolated=[result(part, True) for part in assignment.parts] if reference else None,
        sandboxed=sandboxed,
    )
    report.execution_time = round(time.monotonic() - started, 2)
    return report


def check_submission(
    submission: Path, base: Path, assignment: Assignment, enforce_policy: bool = True
) -> tuple[dict[str, str], dict[str, Violation], dict[str, str]]:
    """Check each editable file of the submission against the policy (``policy.py``).

    Returns the text of each file that passed, the first violation of each part with a region
    in a file that did not (that file is not graded: the edition's copy stays), and the sha256
    of every submitted file.
    """
    submitted: dict[str, str] = {}
    not_graded: dict[str, Violation] = {}
    files: dict[str, str] = {}
    for path in assignment.editable:
        source = submitted_file(submission, path)
        if source is None:
            continue
        data = source.read_bytes()
        files[path] = hashlib.sha256(data).hexdigest()
        edition = (base / path).read_text()
        violation = check_file(path, data, edition, assignment.policy) if enforce_policy else None
        if violation is None:
            submitted[path] = data.decode("utf-8")
            continue
        for region in find_regions(edition, path):
            not_graded.setdefault(region.part, violation)
    return submitted, not_graded, files


@dataclass(slots=True, frozen=True, eq=False)
class Run:
    """One test process: a part's visible or hidden tests, on the plain or an isolated tree.

    ``build`` makes the tree just before the run. A ``private`` tree holds what no other run may
    read (reference code, hidden tests): without a sandbox such runs go one at a time, each tree
    deleted after its run.
    """

    part: str
    isolated: bool
    ids: tuple[str, ...]
    build: Callable[[], Path | RegionError]
    private: bool


def _plan(
    scratch: Path,
    base: Path,
    ids_by_part: dict[str, list[str]],
    submitted: dict[str, str],
    reference: Path | None,
    assignment: Assignment,
) -> list[Run]:
    """The runs of a grade: per part, its visible and its hidden tests, plain and isolated."""
    work = _plain_tree(scratch / "work", base, submitted, hidden=False)
    runs = []
    for part, ids in ids_by_part.items():
        for hidden in (False, True):
            chosen = tuple(i for i in ids if _is_hidden(i) is hidden)
            if not chosen:
                continue
            name = f"{part}-hidden" if hidden else part
            plain = partial(_plain_tree, scratch / f"plain-{name}", base, submitted, hidden=True)
            runs.append(Run(part, False, chosen, plain if hidden else lambda: work, hidden))
            if reference is not None:
                tree = scratch / f"isolated-{name}"
                isolated = partial(
                    _isolated_tree, tree, part, base, reference, submitted, assignment, hidden
                )
                runs.append(Run(part, True, chosen, isolated, True))
    return runs


def _combine(results: list[RunResult]) -> RunResult:
    """One part's result from its runs: every outcome, the worst status, the first detail."""
    outcomes = [outcome for result in results for outcome in result[0]]
    statuses = [result[1] for result in results]
    status = next((s for s in ("timeout", "error", "failed") if s in statuses), "passed")
    detail = next((result[2] for result in results if result[2]), "")
    return outcomes, status, detail


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
    """A digest of every file under ``root``, links included: the content of each file of
    ``tree_files``, and the size, mtime and ctime of the rest (version control, virtual
    environments, caches: too large to read each time, and a write changes its ctime)."""
    digest = hashlib.sha256()
    content = tree_files(root)
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names + [d for d in subdirs if Path(directory, d).is_symlink()]):
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            digest.update(relative.encode() + b"\0")
            if relative in content:
                digest.update(hashlib.sha256(path.read_bytes()).digest())
            else:
                info = path.lstat()
                digest.update(f"{info.st_size} {info.st_mtime_ns} {info.st_ctime_ns}".encode())
    return digest.hexdigest()


def copy_clean(source: Path, target: Path, leave_out: str | None = None) -> None:
    """Copy the files of ``tree_files(source)``, less the folder ``leave_out`` if given."""
    for path, file in tree_files(source).items():
        if leave_out is not None and path.startswith(leave_out + "/"):
            continue
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target / path)


def _plain_tree(tree: Path, base: Path, submitted: dict[str, str], hidden: bool) -> Path:
    """The trusted tree with the submitted files that passed the policy."""
    copy_clean(base, tree, leave_out=None if hidden else HIDDEN_DIR.as_posix())
    for path, text in submitted.items():
        (tree / path).write_text(text)
    return tree


def _isolated_tree(
    tree: Path,
    part: str,
    base: Path,
    reference: Path,
    submitted: dict[str, str],
    assignment: Assignment,
    hidden: bool,
) -> Path | RegionError:
    """The reference's code with the submission's regions of ``part`` transplanted in."""
    copy_clean(base, tree, leave_out=None if hidden else HIDDEN_DIR.as_posix())
    for path in assignment.editable:
        ours = (reference / path).read_text()
        try:
            theirs = submitted.get(path)
            text = ours if theirs is None else restore_regions(ours, theirs, {part}, path)
        except RegionError as exc:
            return exc
        (tree / path).write_text(text)
    return tree


def _is_hidden(nodeid: str) -> bool:
    return nodeid.startswith(HIDDEN_DIR.as_posix() + "/")


def _test_files(base: Path, assignment: Assignment) -> list[str]:
    """The graded test files of the assignment's phases, hidden ones included."""
    phases = {str(part.phase) for part in assignment.parts}
    return assignment.test_files + sorted(
        path.relative_to(base).as_posix()
        for path in (base / HIDDEN_DIR).glob("test_phase*.py")
        if (match := GRADED_TEST_FILE.match(path.name)) and match["phase"] in phases
    )


def _pytest_args(files_or_ids: list[str] | tuple[str, ...], *extra: str) -> list[str]:
    """pytest's options: the grader's own configuration, no conftest, no cache."""
    options = ["-c", GRADER_INI_NAME, "--rootdir", ".", "--noconftest", "-p", "no:cacheprovider"]
    return [*options, "-q", *extra, *files_or_ids]


def _collect(base: Path, files: list[str], assignment: Assignment) -> dict[str, list[str]]:
    """The graded test ids of the trusted tree, by part (collection imports trusted code only)."""
    done = subprocess.run(
        sandbox.python_command(str(base), _pytest_args(files, "--collect-only")),
        cwd=base,
        env=sandbox.environment(),
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


def _run_all(runs: list[Run], timeout: float, sandboxed: bool) -> dict[Run, RunResult]:
    """Every run's outcomes, status and detail. Sandboxed runs go in parallel; without a sandbox
    the private ones go one at a time, after the others."""
    alone = [run for run in runs if run.private and not sandboxed]
    shared = [run for run in runs if run not in alone]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = pool.map(lambda run: _execute(run, timeout, sandboxed), shared)
        done = dict(zip(shared, results, strict=True))
    for run in alone:
        done[run] = _execute(run, timeout, sandboxed)
    return done


def _execute(run: Run, timeout: float, sandboxed: bool) -> RunResult:
    tree = run.build()
    try:
        if isinstance(tree, RegionError):
            return [TestOutcome(i, "failed", str(tree)) for i in run.ids], "error", str(tree)
        return _run_part(tree, list(run.ids), timeout, sandboxed)
    finally:
        if run.private and isinstance(tree, Path):
            shutil.rmtree(tree, ignore_errors=True)


def _run_part(tree: Path, ids: list[str], timeout: float, sandboxed: bool) -> RunResult:
    """Run the tests ``ids`` in ``tree`` (sandboxed if it can); read the reporter's pipe."""
    args = _pytest_args(ids, "-p", "vkv.assignment.reporter")
    read_end, write_end = os.pipe()
    command = sandbox.command(tree, args) if sandboxed else sandbox.python_command(str(tree), args)
    process = subprocess.Popen(
        command,
        cwd=tree,
        env=sandbox.environment(VKV_GRADE_REPORT_FD=str(write_end)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(write_end,),
        start_new_session=True,
    )
    os.close(write_end)
    try:
        data, timed_out = _read_pipe(read_end, process, timeout)
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever the tests left behind
        process.wait()
    return _read_report(data, ids, timed_out, timeout)


def _read_pipe(fd: int, process: subprocess.Popen, timeout: float) -> tuple[bytes, bool]:
    """What the reporter wrote, until every writer closed the pipe, the process exited and
    ``PIPE_GRACE`` passed (a survivor may hold the pipe), or ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    exited_at = None
    while True:
        now = time.monotonic()
        if exited_at is None and process.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > PIPE_GRACE:
            return b"".join(chunks), False
        if now > deadline:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), False
        if size < MAX_REPORT_BYTES:
            chunks.append(chunk)
            size += len(chunk)


def _records(data: bytes) -> list[dict]:
    """The report's JSON objects; anything else (a bad line) is skipped."""
    records = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read_report(data: bytes, ids: list[str], timed_out: bool, timeout: float) -> RunResult:
    """Each test's outcome from the reporter's lines; unreported tests count as failed."""
    phases: dict[str, list[dict]] = {}
    finished, tampered = False, None
    wanted = set(ids)
    for record in _records(data):
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
