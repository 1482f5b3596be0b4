"""Run graded tests of trees in child processes and read back one result per test.

``run_many`` runs many pytest sessions, each in a tree of its own (``vkv`` imported from that
tree), a few at a time. The children fork from a warm server (``pytest_server.py``) that has
imported torch, Hypothesis and pytest once, so a short run does not pay seconds of imports.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

from vkv.assignment.parts import part_of_test

SERVER = Path(__file__).with_name("pytest_server.py")


class TestRunError(RuntimeError):
    """The pytest server could not start or stopped answering."""


@dataclass(slots=True, frozen=True)
class TestResult:
    """One test's outcome: ``passed``, ``failed``, ``error`` or ``skipped``."""

    file: str
    name: str
    outcome: str
    message: str

    @property
    def part(self) -> str | None:
        return part_of_test(Path(self.file).name, self.name)

    @property
    def nodeid(self) -> str:
        return f"{self.file}::{self.name}"


@dataclass(slots=True, frozen=True)
class TestRun:
    """pytest on ``tests`` (files or node ids) of ``tree``, with ``options`` (e.g. ``-x``)."""

    tree: Path
    tests: tuple[str, ...]
    options: tuple[str, ...] = ()


def run_many(
    runs: dict[Hashable, TestRun],
    workers: int,
    timeout: float,
    done: Callable[[Hashable, float], None] = lambda key, seconds: None,
) -> dict[Hashable, list[TestResult] | None]:
    """The results of every run, one per test, ``workers`` runs at a time.

    A run's value is None when pytest wrote no report: it crashed, or ran past ``timeout``
    seconds (its whole process group is killed then). Each run is one pytest session in one
    process, ``-n 0`` (no pytest-xdist inside it), no cache, Hypothesis not shrinking (pass or
    fail is all a check needs), tracebacks as Python prints them (pytest's own, with source
    context, took a stubbed tree's run from 10 s to 68 s). ``done(key, seconds)`` is called as
    each run ends.
    """
    results: dict[Hashable, list[TestResult] | None] = {}
    with tempfile.TemporaryDirectory(prefix="vkv-junit-") as scratch, _Server() as server:
        waiting = list(enumerate(runs))
        started: dict[Hashable, tuple[int, float]] = {}  # key -> (pid, monotonic start)
        while waiting or started or server.unanswered:
            while waiting and len(started) + server.unanswered < workers:
                index, key = waiting.pop(0)
                server.start(key, _request(runs[key], Path(scratch) / f"{index}.xml"))
            for message in server.messages(timeout=0.5):
                key = server.keys[message["id"]]
                if "pid" in message:
                    started[key] = (message["pid"], time.monotonic())
                    continue
                _, began = started.pop(key)
                report = Path(server.requests[message["id"]]["report"])
                results[key] = _parse_junit(report)
                done(key, time.monotonic() - began)
            for pid, began in started.values():
                if time.monotonic() - began > timeout:
                    _kill(pid)
    return results


def _request(run: TestRun, report: Path) -> dict:
    args = [
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "--tb=native",
        f"--junitxml={report}",
        "-o",
        "junit_family=xunit2",
        *run.options,
        *run.tests,
    ]
    env = {
        "PYTHONPATH": str(run.tree),
        "PYTHONDONTWRITEBYTECODE": "1",
        "VKV_HYPOTHESIS_SHRINK": "0",
    }
    return {"tree": str(run.tree), "args": args, "env": env, "report": str(report)}


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


class _Server:
    """The pytest server's process, the requests sent to it and its answers, line by line."""

    def __init__(self) -> None:
        self.keys: dict[str, Hashable] = {}
        self.requests: dict[str, dict] = {}
        self.unanswered = 0  # requests sent, whose child's pid has not come back yet
        self._buffer = b""

    def __enter__(self) -> "_Server":
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        ready = self.messages(timeout=300.0)
        if not ready or not ready[0].get("ready"):
            self.__exit__()
            raise TestRunError("the pytest server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill(self.process.pid)
            self.process.wait()
        self.process.stdout.close()

    def start(self, key: Hashable, request: dict) -> None:
        identifier = str(len(self.keys))
        self.keys[identifier] = key
        self.requests[identifier] = request
        self.unanswered += 1
        line = json.dumps({"id": identifier, **request}) + "\n"
        self.process.stdin.write(line.encode())
        self.process.stdin.flush()

    def messages(self, timeout: float) -> list[dict]:
        """The server's messages that arrive within ``timeout`` seconds (maybe none)."""
        fd = self.process.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], timeout)
        if not readable:
            return []
        data = os.read(fd, 1 << 16)
        if not data:
            raise TestRunError(f"the pytest server exited ({self.process.wait()})")
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        messages = [json.loads(line) for line in lines]
        self.unanswered -= sum("pid" in message for message in messages)
        return messages


def _parse_junit(report: Path) -> list[TestResult] | None:
    """One result per test case of the report; None if there is no report, or half of one."""
    try:
        cases = list(ElementTree.parse(report).getroot().iter("testcase"))
    except (OSError, ElementTree.ParseError):
        return None
    results = []
    for case in cases:
        module = case.get("classname", "")
        file = module.replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        results.append(TestResult(file, case.get("name", ""), outcome, message.strip()))
    return results
