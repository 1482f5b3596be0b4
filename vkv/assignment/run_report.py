"""Reading what a test process reported: the lines ``reporter.py`` wrote on the grade's pipe,
each a JSON record of one phase of one test, then one ``finished`` record.

Nothing in a report is trusted: a line that is not a record of a test the run asked for (or a
second record of a phase, or anything after ``finished``) makes the run an "error" that says
what it saw; a test that never reported counts as failed; a run killed at its timeout says so.
"""

import json
import os
import select
import subprocess
import time
from dataclasses import dataclass

from vkv.assignment.results import RunResult, TestOutcome

MAX_REPORT_BYTES = 64 << 20
MAX_MESSAGE = 4000
PIPE_GRACE = 1.0  # seconds to drain the report after the test process exited
PHASES = ("setup", "call", "teardown")
OUTCOMES = ("passed", "failed", "skipped")


def read_pipe(fd: int, process: subprocess.Popen, timeout: float) -> tuple[bytes, bool]:
    """What the reporter wrote (``MAX_REPORT_BYTES`` at most), until every writer closed the
    pipe, the process exited and ``PIPE_GRACE`` passed (a survivor may hold the pipe), or
    ``timeout`` ran out."""
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


class MalformedReport(ValueError):
    """The report holds a line that is not a record the reporter writes."""


@dataclass(slots=True, frozen=True)
class Record:
    """One phase of one test, as the reporter wrote it."""

    nodeid: str
    when: str
    outcome: str
    message: str
    flagged: str | None


def _records(data: bytes, wanted: set[str]) -> tuple[list[Record], bool, str | None]:
    """The report's records, whether it ended with ``finished``, and the ``tampered`` it gave.

    Raises ``MalformedReport`` naming the first line that is not a record of a test in
    ``wanted`` (a phase at most once each) or the one ``finished`` line, last; any byte
    sequence gives a record list or that exception. A last line without its newline (the
    process was killed while writing it) is left out.
    """
    if len(data) >= MAX_REPORT_BYTES:
        raise MalformedReport(f"the report is larger than {MAX_REPORT_BYTES} bytes")
    records: list[Record] = []
    seen: set[tuple[str, str]] = set()
    lines = data.split(b"\n")[:-1]  # the last piece is empty, or a line cut short by a kill
    for number, line in enumerate(lines, 1):
        try:
            value = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            raise MalformedReport(f"line {number} is not JSON") from None
        if not isinstance(value, dict):
            raise MalformedReport(f"line {number} is not an object")
        if value.get("event") == "finished":
            tampered = value.get("tampered")
            if set(value) != {"event", "tampered"} or not isinstance(tampered, str | None):
                raise MalformedReport(f"line {number}: a malformed finished record")
            if number != len(lines):
                raise MalformedReport(f"line {number}: records after the finished record")
            return records, True, _text(tampered) if tampered is not None else None
        record = _record(value, number, wanted)
        if (record.nodeid, record.when) in seen:
            raise MalformedReport(f"line {number}: a second {record.when} record for a test")
        seen.add((record.nodeid, record.when))
        records.append(record)
    return records, False, None


def _record(value: dict, number: int, wanted: set[str]) -> Record:
    """The record on line ``number``, or ``MalformedReport``."""
    if set(value) != {"nodeid", "when", "outcome", "message", "flagged"}:
        raise MalformedReport(f"line {number}: not a test record")
    nodeid, when, outcome = value["nodeid"], value["when"], value["outcome"]
    message, flagged = value["message"], value["flagged"]
    if not all(isinstance(v, str) for v in (nodeid, when, outcome, message)):
        raise MalformedReport(f"line {number}: a field that should be a string is not")
    if not isinstance(flagged, str | None):
        raise MalformedReport(f"line {number}: flagged is neither a string nor null")
    if nodeid not in wanted:
        raise MalformedReport(f"line {number}: a record for a test this run did not ask for")
    if when not in PHASES or outcome not in OUTCOMES:
        raise MalformedReport(f"line {number}: an unknown phase or outcome")
    flag = _text(flagged) if flagged is not None else None
    return Record(nodeid, when, outcome, _text(message), flag)


def _text(value: str) -> str:
    """A message fit to print: lone surrogates replaced, ``MAX_MESSAGE`` characters at most."""
    return value.encode("utf-8", "replace").decode("utf-8")[-MAX_MESSAGE:]


def read_report(data: bytes, ids: list[str], timed_out: bool, timeout: float) -> RunResult:
    """Each test's outcome from the reporter's lines; unreported tests count as failed.

    The run's status is ``timeout`` if it ran out of time, else ``error`` if the report is
    malformed (every test then fails, flagged), a test was flagged, pytest was tampered with
    or the session did not finish; else ``failed`` or ``passed``.
    """
    try:
        records, finished, tampered = _records(data, set(ids))
    except MalformedReport as exc:
        detail = f"malformed report record: {exc}"
        failed = [TestOutcome(nodeid, "failed", detail) for nodeid in ids]
        return failed, "timeout" if timed_out else "error", detail
    phases: dict[str, list[Record]] = {}
    for record in records:
        phases.setdefault(record.nodeid, []).append(record)
    unreported = "timeout" if timed_out else "missing"
    outcomes = []
    flags = []
    for nodeid in ids:
        own = phases.get(nodeid, [])
        flagged = next((r.flagged for r in own if r.flagged is not None), None)
        failed = [r for r in own if r.outcome == "failed"]
        if tampered is not None:
            outcomes.append(TestOutcome(nodeid, "failed", f"pytest was tampered with: {tampered}"))
        elif flagged is not None:
            flags.append(f"{nodeid.partition('::')[2]}: {flagged}")
            outcomes.append(TestOutcome(nodeid, "failed", flagged))
        elif failed:
            outcomes.append(TestOutcome(nodeid, "failed", failed[0].message))
        elif any(r.when == "call" and r.outcome == "passed" for r in own):
            outcomes.append(TestOutcome(nodeid, "passed"))
        else:
            outcomes.append(TestOutcome(nodeid, unreported, "never reported"))
    if timed_out:
        return outcomes, "timeout", f"killed after {timeout:.0f} s"
    if tampered is not None:
        return outcomes, "error", f"pytest was tampered with ({tampered})"
    if flags:
        more = f" (and {len(flags) - 1} more flagged)" if len(flags) > 1 else ""
        return outcomes, "error", flags[0] + more
    if not finished:
        return outcomes, "error", "the test process ended before the session finished"
    passed = all(o.outcome == "passed" for o in outcomes)
    return outcomes, "passed" if passed else "failed", ""
