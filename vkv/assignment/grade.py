"""``vkv grade``: score a submission part by part, without trusting it.

The submission is never run as it is. The grader copies a *trusted* tree (the course's
student edition, or this repository: tests, configuration, everything but the student's code),
overlays only the files students are meant to edit (``editable`` in ``parts.toml``), byte for
byte, and runs the trusted tests on it:

- one pytest process per part (and one more for its hidden tests), in parallel, each with a
  timeout after which its whole process group is killed; plugin autoloading off, the grader's
  own pytest configuration, no conftest, no cache, no bytecode written;
- inside it, each test runs in a child process of its own, which can report for that test only
  (``reporter.py``); the grader's plugin also detects a submission that patches pytest or a
  module a part may import (torch, math...); the test ids are collected beforehand from the
  trusted tree, a test that never reported (the process exited or crashed early) counts as
  failed, and a report the grader cannot read (a malformed or unexpected record, a second record
  for a phase, a process that died of a signal) fails the run with status "error" and says what
  it saw;
- a file the submission changed outside ``editable`` is reported as "not graded: protected file
  modified" and ignored;
- a solution region that breaks the static policy (``policy.py``: forbidden imports, names,
  attributes...) is not graded: its stub takes its place, and its part alone scores 0, "not
  graded" with the rule and its line; the file's other regions are graded as submitted. A file
  that breaks a rule of the file as a whole (code outside the solution regions changed, not
  UTF-8, a syntax error) is not graded at all: the edition's copy stays, and every part with a
  region in it scores 0;
- each test process starts from a clean interpreter (no editable install, no project root on
  its path) and, where bubblewrap works, inside an OS sandbox that sees only its own tree
  (``sandbox.py``); a part's hidden tests run in a process of their own, so no visible test's
  output can carry them; nothing a test process started outlives it;
- every grade draws a seed (``secrets.randbelow(2**32)``, or ``seed``), given to every test
  process as ``VKV_GRADE_SEED`` and recorded in the report: seeded hidden tests ask for answers
  no table of the visible tests' answers holds.

Scoring: a part's score is its points times the share of its tests that pass. When a part has
hidden tests in the run, it is its points times the *lower* of two shares, that of its visible
tests that pass and that of its hidden tests that pass (the part's detail says so when the
hidden share is the lower one). A part whose tests all fail on stubs
(``NotImplementedError: part X.Y``), its own among them, is reported "not started" rather than
"failed"; a failed part whose failures all come from other parts' stubs says which part to
finish first. With ``isolate``, each part is graded again with the submission's code for that
part only and the reference's code for every other part (the solution regions make the
transplant exact), so that a bug in one part costs that part alone; an editable file the
submission lacks (or that is a link, unreadable, or refused by the policy) counts as the
edition's, stubs and all, never as the reference's. Hidden tests (an instructor-only folder,
``--hidden``) are reported apart.

A grade is a *progress check*, not a grade, when it ran without the sandbox (the submission
could then read the hidden tests and rewrite the trusted tree) or when the tree graded itself
(run without ``--trusted``); the report says so in every format. Hidden tests without a sandbox
are refused unless ``unsafe_no_sandbox`` is set.
"""

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from vkv.assignment import sandbox
from vkv.assignment.parts import GRADED_TEST_FILE, Assignment, Part
from vkv.assignment.policy import POLICY_TEST_SUFFIX, Verdict, Violation, check_file, graded_text
from vkv.assignment.regions import RegionError, find_regions, restore_regions, stub_regions
from vkv.assignment.results import (
    HIDDEN_DIR,
    GradeReport,
    PartResult,
    RunResult,
    TestOutcome,
    is_hidden,
    part_of_nodeid,
)
from vkv.assignment.run_report import read_pipe, read_report
from vkv.assignment.trees import (
    copy_clean,
    first_change,
    no_bytecode_written,
    protected_changes,
    submitted_file,
    tree_state,
)

GRADER_INI = "[pytest]\naddopts =\npython_files = test_*.py\npythonpath = tests\n"
GRADER_INI_NAME = "vkv-grader.ini"
STUB_ERROR = re.compile(r"NotImplementedError: part (\d+\.\d+):")


def grade(
    submission: Path,
    trusted: Path | None = None,
    *,
    hidden: Path | None = None,
    reference: Path | None = None,
    timeout: float = 300.0,
    parts: set[str] | None = None,
    require_sandbox: bool = False,
    unsafe_no_sandbox: bool = False,
    enforce_policy: bool = True,
    seed: int | None = None,
    progress: Callable[[PartResult, PartResult | None], None] | None = None,
) -> GradeReport:
    """Grade ``submission`` against the tests of ``trusted`` (default: itself).

    With ``reference``, also grade each part in isolation (see the module docstring). With
    ``parts``, grade only those parts (and only their phases' test files). With
    ``require_sandbox``, raise ``RuntimeError`` rather than grade without bubblewrap. ``hidden``
    tests without a sandbox raise ``RuntimeError`` unless ``unsafe_no_sandbox`` is set (the
    submission could read them). ``seed`` (default: drawn at random) is every test process's
    ``VKV_GRADE_SEED``. ``enforce_policy=False`` (not offered by the CLI) lets code the policy
    would refuse run, so that the layers behind the policy (the sandbox, the guard) can be
    tested on their own. ``progress(plain, isolated)`` is called once per part as soon as all of
    its runs have ended (``isolated`` is None without ``reference``), in the order parts finish:
    what a person watching a long grade sees; the report is still the answer (a grade can be
    void after every part reported).
    """
    started = time.monotonic()
    sandboxed = sandbox.available()
    if require_sandbox and not sandboxed:
        raise RuntimeError(f"no sandbox to grade in: {sandbox.why_unavailable()}")
    if hidden is not None and not sandboxed and not unsafe_no_sandbox:
        raise RuntimeError(
            f"refusing to run hidden tests without a sandbox ({sandbox.why_unavailable()}): the "
            "submission could read them. Grade where bubblewrap works, or pass "
            "--unsafe-no-sandbox (unsafe_no_sandbox=True) for a progress check"
        )
    seed = secrets.randbelow(2**32) if seed is None else seed
    trusted = trusted or submission
    self_graded = trusted.resolve() == submission.resolve()  # a progress check, never void
    assignment = Assignment.load(trusted)
    if parts is not None:
        assignment = assignment.restricted_to(parts)

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

    with (
        no_bytecode_written(),
        tempfile.TemporaryDirectory(prefix="vkv-grade-", ignore_cleanup_errors=True) as scratch,
    ):
        base = Path(scratch) / "base"
        copy_clean(trusted, base)
        if hidden is not None:
            copy_clean(hidden, base / HIDDEN_DIR)
        (base / GRADER_INI_NAME).write_text(GRADER_INI)
        ids_by_part = _collect(base, _test_files(base, assignment), assignment, seed)
        trusted_before = {} if self_graded else tree_state(trusted)  # after _collect's writes
        submitted, not_graded, files = check_submission(
            submission, base, assignment, enforce_policy
        )
        runs = _plan(Path(scratch), base, ids_by_part, submitted, reference, assignment)
        graded = [run for run in runs if run.part not in not_graded]
        done: dict[Run, RunResult] = {}
        waiting = Counter(run.part for run in graded)

        def tell(part: Part) -> None:
            if progress is not None:
                progress(result(part, False), result(part, True) if reference else None)

        def finished(run: Run) -> None:
            waiting[run.part] -= 1
            if waiting[run.part] == 0:
                tell(assignment.part(run.part))

        for part in (part for part in assignment.parts if part.id not in waiting):
            tell(part)  # not graded, or no tests: its result is known now
        _run_all(graded, Settings(timeout, sandboxed, seed), done, finished)
    changed = None if self_graded else first_change(trusted_before, tree_state(trusted))
    if changed is not None:
        raise RuntimeError(
            f"the trusted tree {trusted} changed while grading (a submission wrote to it; the "
            f"first changed path: {changed}): this grade is void; restore the tree before "
            "grading anything else"
        )

    report = GradeReport(
        parts=[result(part, False) for part in assignment.parts],
        protected_modified=protected_changes(submission, trusted, assignment),
        files=files,
        not_graded=_reasons_by_file(not_graded.values()),
        isolated=[result(part, True) for part in assignment.parts] if reference else None,
        sandboxed=sandboxed,
        progress_check=not sandboxed or self_graded,
        note=_progress_note(sandboxed, self_graded),
        seed=seed,
    )
    report.execution_time = round(time.monotonic() - started, 2)
    return report


def _reasons_by_file(violations) -> dict[str, str]:
    """The policy's reasons, one line per file (a file may have several refused regions)."""
    by_file: dict[str, list[str]] = {}
    for violation in violations:
        reasons = by_file.setdefault(violation.path, [])
        if str(violation) not in reasons:
            reasons.append(str(violation))
    return {path: "; ".join(reasons) for path, reasons in by_file.items()}


def _progress_note(sandboxed: bool, self_graded: bool) -> str:
    """Why a grade is only a progress check ("" if it is a grade)."""
    reasons = []
    if not sandboxed:
        reasons.append(
            "it ran without a sandbox (no usable bubblewrap), where a submission can read the "
            "hidden tests and rewrite the trusted tree"
        )
    if self_graded:
        reasons.append("the tree was graded by its own tests (no --trusted tree)")
    return "a progress check, not a grade: " + "; ".join(reasons) if reasons else ""


def check_submission(
    submission: Path, base: Path, assignment: Assignment, enforce_policy: bool = True
) -> tuple[dict[str, bytes], dict[str, Violation], dict[str, str]]:
    """Check each editable file of the submission against the policy (``policy.py``).

    Returns the bytes of each file to grade (as submitted, but with each region the policy
    refused replaced by the edition's stub), the violation of each part that is not graded (a
    refused region's own, or the file's where the file as a whole was refused: then the
    edition's copy stays, and every part with a region in it is not graded), and the sha256 of
    every submitted file. A file that is missing, a link or unreadable is not submitted: the
    edition's copy stays.
    """
    submitted: dict[str, bytes] = {}
    not_graded: dict[str, Violation] = {}
    files: dict[str, str] = {}
    for path in assignment.editable:
        source = submitted_file(submission, path)
        try:
            data = source.read_bytes() if source is not None else None
        except OSError:
            data = None
        if data is None:
            continue
        files[path] = hashlib.sha256(data).hexdigest()
        edition = (base / path).read_text()
        verdict = Verdict()
        if enforce_policy:
            verdict = check_file(path, data, edition, assignment.policy)
        if verdict.whole_file is not None:
            for region in find_regions(edition, path):
                not_graded.setdefault(region.part, verdict.whole_file)
            continue
        not_graded |= verdict.regions
        if verdict.regions:
            data = graded_text(data.decode("utf-8"), edition, verdict, path).encode("utf-8")
        submitted[path] = data
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
    submitted: dict[str, bytes],
    reference: Path | None,
    assignment: Assignment,
) -> list[Run]:
    """The runs of a grade: per part, its visible and its hidden tests, plain and isolated."""
    work = _plain_tree(scratch / "work", base, submitted, hidden=False)
    runs = []
    for part, ids in ids_by_part.items():
        for hidden in (False, True):
            chosen = tuple(i for i in ids if is_hidden(i) is hidden)
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
            others = sorted(set().union(*stubs))
            those = "that part" if len(others) == 1 else "those parts"
            detail = f"fails on the stub of {_parts(others)}: finish {those} first"
    return PartResult(part, tuple(tests), status, detail)


def _parts(ids: list[str]) -> str:
    """``part 1.2``, ``parts 1.2 and 1.3``, ``parts 1.1, 1.2 and 1.3``."""
    if len(ids) == 1:
        return f"part {ids[0]}"
    return f"parts {', '.join(ids[:-1])} and {ids[-1]}"


def _plain_tree(tree: Path, base: Path, submitted: dict[str, bytes], hidden: bool) -> Path:
    """The trusted tree with the submitted files that passed the policy, byte for byte."""
    copy_clean(base, tree, None if hidden else HIDDEN_DIR.as_posix(), test_caches=True)
    for path, data in submitted.items():
        (tree / path).write_bytes(data)
    return tree


def _isolated_tree(
    tree: Path,
    part: str,
    base: Path,
    reference: Path,
    submitted: dict[str, bytes],
    assignment: Assignment,
    hidden: bool,
) -> Path | RegionError:
    """The reference's code with the submission's regions of ``part`` transplanted in.

    An editable file that was not submitted (missing, a link, unreadable, refused by the
    policy) gives ``part`` the edition's stubs: the reference's file with ``part`` stubbed.
    """
    copy_clean(base, tree, None if hidden else HIDDEN_DIR.as_posix(), test_caches=True)
    for path in assignment.editable:
        ours = (reference / path).read_bytes().decode("utf-8")
        theirs = submitted.get(path)
        try:
            if theirs is None:
                text = stub_regions(ours, {part}, path)
            else:
                text = restore_regions(ours, theirs.decode("utf-8"), {part}, path)
        except RegionError as exc:
            return exc
        except UnicodeDecodeError:  # only where the policy, which requires UTF-8, is off
            return RegionError(f"{path} is not UTF-8 text")
        (tree / path).write_bytes(text.encode("utf-8"))
    return tree


def _test_files(base: Path, assignment: Assignment) -> list[str]:
    """The graded test files of the assignment's phases, hidden ones included."""
    phases = {str(part.phase) for part in assignment.parts}
    return assignment.test_files + sorted(
        path.relative_to(base).as_posix()
        for path in (base / HIDDEN_DIR).glob("test_phase*.py")
        if (match := GRADED_TEST_FILE.match(path.name)) and match["phase"] in phases
    )


def _pytest_args(files_or_ids: list[str] | tuple[str, ...], *extra: str) -> list[str]:
    """pytest's options: the grader's own configuration, no conftest, no cache, tracebacks as
    Python prints them (a student sees none, and pytest's own are slow to build)."""
    options = ["-c", GRADER_INI_NAME, "--rootdir", ".", "--noconftest", "--tb=native"]
    return [*options, "-p", "no:cacheprovider", "-q", *extra, *files_or_ids]


def _collect(
    base: Path, files: list[str], assignment: Assignment, seed: int
) -> dict[str, list[str]]:
    """The graded test ids of the trusted tree, by part (collection imports trusted code only).
    Being trusted, it writes the bytecode of what it imports, which the graded processes
    (``python -B``) then read rather than compile again; the trusted tree is fingerprinted after.

    A part's policy test is left out: the grader checked the same policy before anything ran
    (a refused region is graded as its stub), and counted it would give points for any code
    the policy admits."""
    done = subprocess.run(
        sandbox.python_command(str(base), _pytest_args(files, "--collect-only"), True),
        cwd=base,
        env=sandbox.environment(seed),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        raise RuntimeError(f"collecting the trusted tests failed:\n{done.stdout[-2000:]}")
    by_part: dict[str, list[str]] = {part: [] for part in assignment.part_ids}
    for nodeid in ids:
        part = part_of_nodeid(nodeid)
        if part in by_part and not nodeid.endswith(POLICY_TEST_SUFFIX):
            by_part[part].append(nodeid)
    return by_part


@dataclass(slots=True, frozen=True)
class Settings:
    """How every run of a grade goes: its time limit (per run, and per test), in the sandbox
    or not, with which seed."""

    timeout: float
    sandboxed: bool
    seed: int


def _run_all(
    runs: list[Run], settings: Settings, done: dict[Run, RunResult], finished: Callable[[Run], None]
) -> None:
    """Put every run's outcomes, status and detail in ``done``, calling ``finished(run)`` as each
    ends. Sandboxed runs go in parallel, in order; without a sandbox private ones go last, alone."""
    alone = [run for run in runs if run.private and not settings.sandboxed]
    shared = [run for run in runs if run not in alone]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {pool.submit(_execute, run, settings): run for run in shared}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            finished(futures[future])
    for run in alone:
        done[run] = _execute(run, settings)
        finished(run)


def _execute(run: Run, settings: Settings) -> RunResult:
    tree = run.build()
    try:
        if isinstance(tree, RegionError):
            return [TestOutcome(i, "failed", str(tree)) for i in run.ids], "error", str(tree)
        return _run_part(tree, list(run.ids), settings)
    finally:
        if run.private and isinstance(tree, Path):
            shutil.rmtree(tree, ignore_errors=True)


def _run_part(tree: Path, ids: list[str], settings: Settings) -> RunResult:
    """Run the tests ``ids`` in ``tree`` (sandboxed if it can); read the reporter's pipe."""
    args = _pytest_args(ids, "-p", "vkv.assignment.reporter", "--capture=no")
    read_end, write_end = os.pipe()
    if settings.sandboxed:
        command = sandbox.command(tree, args)
    else:
        command = sandbox.python_command(str(tree), args)
    process = subprocess.Popen(
        command,
        cwd=tree,
        env=sandbox.environment(
            settings.seed,
            VKV_GRADE_REPORT_FD=str(write_end),
            VKV_GRADE_TEST_TIMEOUT=str(settings.timeout),
            VKV_GRADE_PRIVATE_TMP="1" if settings.sandboxed else "0",
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(write_end,),
        start_new_session=True,
    )
    os.close(write_end)
    try:
        data, timed_out = read_pipe(read_end, process, settings.timeout)
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever the tests left behind
        process.wait()
    return read_report(data, ids, timed_out, settings.timeout)
