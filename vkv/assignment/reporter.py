"""The grader's pytest plugin: every test in a process of its own, a checked report, a guard.

``vkv grade`` runs pytest with ``-p vkv.assignment.reporter`` and ``--capture=no`` (plugin
autoloading off, the grader's own configuration, no conftest) and reads the results from the
pipe whose file descriptor is ``VKV_GRADE_REPORT_FD``, never from pytest's exit code or anything
the tests print.

**One process per test.** The pytest process (the *parent*) collects the tests and runs none:
collection imports the graded modules, but submitted code sits in function bodies (the static
policy's rule), so none of it runs there. For each test item the parent forks a *child*, which
closes every file descriptor but 0 to 2 and the write end of a pipe made for it alone (so the
grader's pipe among them), runs the item's setup, call and teardown
(``_pytest.runner.runtestprotocol`` with no next item: module- and session-scoped fixtures are
set up and torn down in each child), checks the guard, writes its reports to its pipe as JSON
lines (``pytest_report_to_serializable``) and leaves with ``os._exit``. The parent, made
non-dumpable first (``PR_SET_DUMPABLE`` 0, so that no child can open ``/proc/<parent>/fd/N``
or ptrace it; a process with ``CAP_SYS_PTRACE``, root outside the sandbox, still can: one
reason a grade without the sandbox is only a progress check), reads at most
``MAX_TEST_REPORT_BYTES`` for at most ``VKV_GRADE_TEST_TIMEOUT`` seconds (default 300), reaps
the child and kills its process group (the child dies with the parent, too). It accepts a
child's report only if every line is a TestReport for that item's node id, with each of setup,
call and teardown at most once (call exactly when setup passed, setup and teardown always), and
the child exited with status 0. Anything else (a record for another test, a second record for a
phase, a non-dict, a list where a string belongs, bad JSON, a death by a signal, a nonzero
status, no report) makes that test a *flagged* failure, whose message says what was seen ("the
test process reported for another test", "malformed report record: ...", "the test process
died (signal 9)"). A child's code can so speak for its own test only.

The parent writes the checked result to the grader's pipe, one line per phase:
``{"nodeid", "when", "outcome", "message", "flagged"}`` (``flagged``: None, or why the test
failed whatever it reported), and last ``{"event": "finished", "tampered": None | str}``, which
tells the grader the session was not cut short.

**Nothing of a test reaches the next one.** Each child runs in a fresh scratch folder of its own
(its ``TMPDIR`` and ``HOME``), deleted after the test; the parent is the *subreaper* of every
process a test starts (``PR_SET_CHILD_SUBREAPER``), so that a daemon that left the test's
process group is still its child, and kills them all after each test; where ``/tmp`` is the
run's own (the sandbox's, ``VKV_GRADE_PRIVATE_TMP=1``), whatever a test added there is deleted
too.

**What a student sees of a failure is what the test chose to say** (``_shown``): a visible
test's failed assertion shows its message, any other exception its type and the first line of
its message; a hidden test shows one line (an assertion failed, or which exception was raised).
Never the traceback, whose source lines would carry the hidden test's code, or under
``--isolate`` the reference's, into the student's report.

pytest-forked does the same fork per test, but its child inherits every file descriptor of the
parent (the grader's pipe included) and its report comes back unchecked, so it is not used.

**The guard** (``guard.py``). When pytest is configured, before any test module (and so any
submitted code) is imported, it records the identity of every function, class and descriptor
(and each function's code object) of pytest's runner, reports and collection machinery, of the
``pytest`` namespace, of ``builtins``, of Hypothesis and of this module, and of the members of
their classes, with the hooks and the registered plugins (when the session starts, just before
collection). The modules a part may import (``PART_MODULES``: torch, ``torch.nn.functional``,
``math``, ``heapq``...) are recorded the same way, when the session starts if they are imported
then, else after collection. Each test item's function (``obj``, ``_obj``, ``function``) and its
code are recorded after collection and checked before and after the test runs, and no profile or
trace function may be installed. The child checks all of it after its test: a change makes its
test fail (the call's report, else the setup's, says "pytest was tampered with: torch.equal",
say), which the parent flags. The parent checks it after collection and after every test: a
change there (only code run at collection could make one) marks every later test and the
``finished`` line as tampered, which the grader scores as failed.

This is the last of three layers. The static policy (``policy.py``) keeps submitted code from
naming anything it would need to tamper with, and the sandbox (``sandbox.py``) bounds what an
escape could reach; the guard catches tampering that got past both from inside a test process,
and the fork confines what is left to the one test whose process it ran in.
"""

import builtins
import contextlib
import importlib
import json
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import time

import pytest
from _pytest.runner import runtestprotocol

from vkv.assignment.guard import Guard

GUARDED_MODULES = (
    "vkv.assignment.reporter",
    "vkv.assignment.guard",
    "json",
    "json.encoder",
    "hypothesis.core",
    "hypothesis.stateful",
    "hypothesis.internal.conjecture.engine",
    "_pytest.runner",
    "_pytest.python",
    "_pytest.reports",
    "_pytest.main",
    "_pytest.outcomes",
    "_pytest.nodes",
    "_pytest.fixtures",
    "_pytest.skipping",
    "pluggy._callers",
    "pluggy._hooks",
    "pluggy._manager",
    "pytest",
    "builtins",
)
PART_MODULES = (
    "torch",
    "torch.nn.functional",
    "math",
    "heapq",
    "bisect",
    "collections",
    "itertools",
    "xxhash",
    "struct",
    "functools",
    "operator",
    "copy",
    "typing",
)
TAMPERED = "pytest was tampered with"
PHASES = ("setup", "call", "teardown")
OUTCOMES = ("passed", "failed", "skipped")
MAX_TEST_REPORT_BYTES = 8 << 20
MAX_MESSAGE = 4000
CHILD_GRACE = 1.0  # seconds to wait for the pipe's end after the child exited
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
STUB_FAILURE = re.compile(r"NotImplementedError: part \d+\.\d+:.{0,200}")
EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]{0,79}")
HIDDEN_DIR = "tests/hidden/"
CHILD_FAILED = 70  # the child's status when its own protocol raised


def _test_function(item: pytest.Item) -> tuple[object, ...]:
    """What runs for a test item: its function objects and their code."""
    found = tuple(vars(item).get(name) for name in ("obj", "_obj", "function"))
    return found + tuple(getattr(f, "__code__", None) for f in found)


def _same(a: tuple[object, ...] | None, b: tuple[object, ...] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


Result = tuple[list[tuple[str, str, str]], str | None]  # (when, outcome, message)s, flagged


class Reporter:
    def __init__(
        self, config: pytest.Config, fd: int, test_timeout: float, private_tmp: bool
    ) -> None:
        self.config = config
        self.private_tmp = private_tmp
        self.tmp_entries = set(os.listdir(tempfile.gettempdir()))
        self.pid = os.getpid()
        self.out = os.fdopen(fd, "w", encoding="utf-8")
        self.test_timeout = test_timeout
        self.guard = Guard()
        self.plugins: tuple[str, ...] = ()
        self.functions: dict[str, tuple[object, ...]] = {}
        self.tampered: str | None = None

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def plugin_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.config.pluginmanager.list_name_plugin())

    def verify(self) -> None:
        """Set ``tampered`` to what changed since the guard was armed, if anything did."""
        if self.tampered is not None:
            return
        if sys.getprofile() is not None or sys.gettrace() is not None:
            self.tampered = "a profile or trace function was installed"
        elif self.plugin_names() != self.plugins:
            self.tampered = "plugins"
        else:
            self.tampered = self.guard.changed()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        for name in GUARDED_MODULES:  # before collection imports any test module
            self.guard.add_module(name)
        for name in PART_MODULES:
            if name in sys.modules:
                self.guard.add_module(name)
        self.guard.add_namespace("config.hook", vars(self.config.hook))
        self.plugins = self.plugin_names()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.functions = {item.nodeid: _test_function(item) for item in session.items}
        self.verify()
        for name in PART_MODULES:  # imported by collection: no submitted code has run yet
            if name in sys.modules and name not in self.guard.modules:
                self.guard.add_module(name)

    def check_item(self, item: pytest.Item) -> None:
        if self.tampered is not None:
            return
        if "runtest" in vars(item):
            self.tampered = f"{item.nodeid}: runtest replaced on the item"
        elif not _same(_test_function(item), self.functions.get(item.nodeid)):
            self.tampered = f"{item.nodeid}: the test function replaced on the item"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self.check_item(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.check_item(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        """Run ``item`` in a child process; write its checked result to the grader's pipe."""
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        self.check_item(item)
        if self.tampered is None:
            phases, flagged = self.run_alone(item)
            self.verify()
        if self.tampered is not None:
            flagged = f"{TAMPERED}: {self.tampered}"
            phases = [("call", "failed", flagged)]
        for when, outcome, message in phases:
            record = {"nodeid": item.nodeid, "when": when, "outcome": outcome}
            self.write(record | {"message": message, "flagged": flagged})
            report = pytest.TestReport(
                item.nodeid, item.location, {}, outcome, message or None, when
            )
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def run_alone(self, item: pytest.Item) -> Result:
        """Fork a child to run ``item``; its reports, checked, or a flagged failure."""
        read_end, write_end = os.pipe()
        scratch = tempfile.mkdtemp(prefix="vkv-test-")
        pid = os.fork()
        if pid == 0:
            self.child(item, write_end, scratch)  # never returns
        os.close(write_end)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        try:
            data, status, problem = self.read_child(pid, read_end)
        finally:
            os.close(read_end)
            self.clean_up(scratch)
        if problem is not None:
            return [("call", "failed", problem)], problem
        return _checked(item, data, status)

    def clean_up(self, scratch: str) -> None:
        """After a test: kill every process it left (this process is their subreaper, so even a
        daemon that left the test's process group is its child now), delete its scratch folder
        and, where ``/tmp`` is this run's own (the sandbox's), whatever the test put there."""
        for _ in range(100):
            children = _children()
            if not children:
                break
            for pid in children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        shutil.rmtree(scratch, ignore_errors=True)
        if self.private_tmp:
            tmp = tempfile.gettempdir()
            for name in set(os.listdir(tmp)) - self.tmp_entries:
                path = os.path.join(tmp, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def child(self, item: pytest.Item, write_end: int, scratch: str) -> None:
        """In the child: run the test in a fresh scratch folder (its ``TMPDIR`` and ``HOME``),
        check the guard, send the reports, leave."""
        status = CHILD_FAILED
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a killed run takes its test along
            if os.getppid() != self.pid:
                return
            os.setpgid(0, 0)
            os.environ["TMPDIR"] = os.environ["HOME"] = scratch
            tempfile.tempdir = None
            os.closerange(3, write_end)
            os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
            reports = runtestprotocol(item, nextitem=None, log=False)
            self.verify()
            if self.tampered is not None:  # the call's report, else the setup's, says so
                report = next((r for r in reports if r.when == "call"), reports[0])
                report.outcome, report.longrepr = "failed", f"{TAMPERED}: {self.tampered}"
            lines = []
            for report in reports:
                data = self.config.hook.pytest_report_to_serializable(
                    config=self.config, report=report
                )
                lines.append(json.dumps(data, default=str).encode() + b"\n")
            payload = memoryview(b"".join(lines))
            while payload:
                payload = payload[os.write(write_end, payload) :]
            status = 0
        finally:
            os._exit(status)

    def read_child(self, pid: int, fd: int) -> tuple[bytes, int, str | None]:
        """What the child wrote, its wait status, and what went wrong reading it, if anything.

        Reads until the pipe's end (or ``CHILD_GRACE`` after the child exited, a process it
        started may hold the pipe), ``MAX_TEST_REPORT_BYTES`` or the per-test time limit; then
        kills the child's process group and reaps the child.
        """
        deadline = time.monotonic() + self.test_timeout
        chunks: list[bytes] = []
        size, status, exited_at, problem = 0, None, None, None
        while True:
            now = time.monotonic()
            if status is None:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    status, exited_at = wait_status, now
            if exited_at is not None and now - exited_at > CHILD_GRACE:
                break
            if now > deadline:
                problem = f"the test ran past {self.test_timeout:g} s and was killed"
                break
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_TEST_REPORT_BYTES:
                problem = f"the test process wrote more than {MAX_TEST_REPORT_BYTES} bytes"
                break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if status is None:
            _, status = os.waitpid(pid, 0)
        return b"".join(chunks), status, problem

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.verify()
        self.write({"event": "finished", "tampered": self.tampered})
        self.out.close()


def _checked(item: pytest.Item, data: bytes, status: int) -> Result:
    """The child's reports of ``item`` as (when, outcome, message), and why they are refused if
    they are (then a single failed call carries the reason)."""
    phases: dict[str, tuple[str, str]] = {}
    problem = None
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            problem = "malformed report record: not JSON"
        else:
            problem = _record_problem(item, record, phases)
        if problem is not None:
            break
    if problem is None and os.WIFSIGNALED(status):
        problem = f"the test process died (signal {os.WTERMSIG(status)})"
    elif problem is None and os.WEXITSTATUS(status) != 0:
        problem = f"the test process exited with status {os.WEXITSTATUS(status)}"
    elif problem is None:
        setup = phases.get("setup", ("", ""))[0]
        wanted = set(PHASES) if setup == "passed" else {"setup", "teardown"}
        if set(phases) != wanted:
            problem = f"the test process reported the phases {sorted(phases)} only"
    if problem is not None:
        return [("call", "failed", problem)], problem
    tampered = [m for outcome, m in phases.values() if m.startswith(f"{TAMPERED}: ")]
    return [(when, *phases[when]) for when in PHASES if when in phases], next(iter(tampered), None)


def _record_problem(
    item: pytest.Item, record: object, phases: dict[str, tuple[str, str]]
) -> str | None:
    """Why ``record`` is not a report of one more phase of ``item``; else None, and the phase's
    (outcome, message) added to ``phases``."""
    if not isinstance(record, dict) or record.get("$report_type") != "TestReport":
        return "malformed report record: not a test report"
    nodeid, when, outcome = record.get("nodeid"), record.get("when"), record.get("outcome")
    if not isinstance(nodeid, str) or not isinstance(when, str) or not isinstance(outcome, str):
        return "malformed report record: nodeid, when and outcome must be strings"
    if nodeid != item.nodeid:
        return f"the test process reported for another test ({nodeid[:200]!r})"
    if when not in PHASES or outcome not in OUTCOMES:
        return f"malformed report record: phase {when[:20]!r}, outcome {outcome[:20]!r}"
    if when in phases:
        return f"malformed report record: a second record for the {when} phase"
    message = ""
    if outcome != "passed":
        try:
            report = item.config.hook.pytest_report_from_serializable(
                config=item.config, data=record
            )
            message = _shown(report.longrepr, item.nodeid.startswith(HIDDEN_DIR))
        except Exception as exc:  # any shape pytest cannot read back is malformed
            return f"malformed report record: {type(exc).__name__} reading its failure"
    phases[when] = (outcome, message)
    return None


def _shown(longrepr: object, hidden: bool) -> str:
    """What a student is shown of a failure: what the test chose to say, never the traceback
    (its source lines would show the hidden test's code, or under ``--isolate`` the reference's).

    A visible test's failed assertion (or ``pytest.fail``) shows its message; any other
    exception its type and the first line of its message. A hidden test shows one line: that an
    assertion failed, or which exception was raised. A stub's ``NotImplementedError: part X.Y:``
    line is kept as it is, so that the grader can tell a part not started.
    """
    crash = getattr(longrepr, "reprcrash", None)
    text = str(crash.message if crash is not None else longrepr)
    if text.startswith(f"{TAMPERED}: "):
        return text[:MAX_MESSAGE]
    stub = STUB_FAILURE.match(text)
    if stub is not None:
        return stub[0]
    first = text.split("\n", 1)[0]
    kind = first.split(":", 1)[0].strip()
    kind = kind if EXCEPTION_NAME.fullmatch(kind) else "an exception"
    assertion = kind in ("AssertionError", "Failed")
    if hidden:
        return "a hidden assertion failed" if assertion else f"{kind} raised"
    return text[:MAX_MESSAGE] if assertion else first[:300]


def _children() -> list[int]:
    """The pids of this process's living children (``/proc``'s list of each of its threads)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
    return found


def _prctl(option: int, value: int) -> None:
    """``prctl(option, value)`` where the C library has it (Linux); nothing elsewhere."""
    with contextlib.suppress(ImportError, OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def pytest_configure(config: pytest.Config) -> None:
    for name in GUARDED_MODULES:  # loaded now, so that the baseline holds them
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    fd = os.environ.pop("VKV_GRADE_REPORT_FD", None)
    test_timeout = float(os.environ.pop("VKV_GRADE_TEST_TIMEOUT", "300"))
    if fd is None:
        return
    if config.getoption("capture", "no") != "no":
        raise pytest.UsageError(
            "vkv.assignment.reporter runs each test in a child process that closes the "
            "capture's files: run pytest with --capture=no"
        )
    private_tmp = os.environ.pop("VKV_GRADE_PRIVATE_TMP", "") == "1"
    _prctl(PR_SET_DUMPABLE, 0)  # no process of this user may ptrace it or open its fds
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a test leaves running is adopted here, and killed
    reporter = Reporter(config, int(fd), test_timeout, private_tmp)
    config.pluginmanager.register(reporter, "vkv-grade-reporter")


_ = builtins  # guarded by name in GUARDED_MODULES; imported so that it is in sys.modules
