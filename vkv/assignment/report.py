"""The forms a grade takes: a terminal table, JSON, Gradescope's results.json, GitHub
Classroom's runner result, Markdown.

The JSON form (``vkv-grade/1``) is what the auto-grading workflow passes from the unprivileged
job to the one that comments; that job validates it and renders the comment itself
(``comment.py``), so nothing a submission prints reaches a comment.

Every form says when the grade is only a progress check (``GradeReport.progress_check``: no
sandbox, or a tree graded by its own tests): the table's last line, ``"progress_check": true``
and a ``"note"`` in JSON, the first line of Gradescope's ``output``, a quoted line in Markdown.
Each also gives the grade's seed (``VKV_GRADE_SEED``). Classroom's result has no place for
either: its reporter shows only the tests, so ``vkv grade --output`` also prints the table.
"""

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vkv.assignment import comment
from vkv.assignment.results import GradeReport, PartResult, TestOutcome

MAX_OUTPUT = 2000
FAILING_SHOWN = 3


def as_dict(report: GradeReport) -> dict:
    document = {
        "schema": "vkv-grade/1",
        "score": report.score,
        "max_score": report.max_score,
        "execution_time": report.execution_time,
        "parts": [_part(result) for result in report.parts],
        "protected_modified": report.protected_modified,
        "not_graded": report.not_graded,
        "files": report.files,
        "sandboxed": report.sandboxed,
        "progress_check": report.progress_check,
        "seed": report.seed,
    }
    if report.progress_check:
        document["note"] = report.note
    if report.isolated is not None:
        document["isolated"] = [_part(result) for result in report.isolated]
        document["isolated_score"] = round(sum(r.score for r in report.isolated), 2)
    return document


def _part(result: PartResult) -> dict:
    return {
        "id": result.part.id,
        "title": result.part.title,
        "status": result.status,
        "detail": result.full_detail,
        "score": result.score,
        "max_score": result.part.points,
        "passed": result.passed,
        "total": result.total,
        "failed_tests": [t.nodeid for t in result.tests if t.outcome != "passed"],
    }


def as_json(report: GradeReport) -> str:
    return json.dumps(as_dict(report), indent=2)


def as_markdown(report: GradeReport) -> str:
    parts = {r.part.id: (r.part.title, r.part.points) for r in report.parts}
    text = comment.as_markdown(comment.validate(as_dict(report), parts))
    return text + f"\n> {_sandbox_line(report)}\n"


def as_gradescope(report: GradeReport) -> str:
    """Gradescope's ``results.json``: one entry per part, and one for its hidden tests if any.

    A part's points are split between its visible and hidden tests by their numbers; hidden
    entries are shown ``after_due_date``. Each entry scores its own tests' share; the top-level
    ``score`` (which Gradescope takes over the entries' sum) is the grade's, where a part with
    hidden tests scores its points times the lower of the two shares.
    """
    tests = []
    for result in report.parts:
        details = {False: result.detail, True: result.full_detail}  # visible: no hidden shares
        for hidden in (False, True):
            group = [t for t in result.tests if t.hidden is hidden]
            if not group:
                continue
            max_score = round(result.part.points * len(group) / result.total, 2)
            passed = sum(t.outcome == "passed" for t in group)
            tests.append(
                {
                    "name": f"{result.part.id} {result.part.title}"
                    + (" (hidden tests)" if hidden else ""),
                    "number": result.part.id,
                    "score": round(max_score * passed / len(group), 2),
                    "max_score": max_score,
                    "status": "passed" if passed == len(group) else "failed",
                    "output": _clip("\n".join(_outcome(group, result.status, details[hidden]))),
                    "visibility": "after_due_date" if hidden else "visible",
                }
            )
    lines = [_sandbox_line(report)] if report.progress_check else []
    lines += [f"{path} sha256 {digest}" for path, digest in sorted(report.files.items())]
    lines += [f"not graded: protected file modified: {path}" for path in report.protected_modified]
    lines += list(report.not_graded.values())
    if not report.progress_check:
        lines.append(_sandbox_line(report))
    document = {
        "score": report.score,
        "execution_time": round(report.execution_time),
        "output": _clip("\n".join(lines)),
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }
    return json.dumps(document, indent=2)


def _outcome(tests: list[TestOutcome], status: str, detail: str) -> list[str]:
    """A group of tests in a results file: "k/n tests passed (status: detail)", then
    "nodeid: message" for each test that did not pass."""
    passed = sum(test.outcome == "passed" for test in tests)
    summary = f"{passed}/{len(tests)} tests passed ({status}" + (f": {detail})" if detail else ")")
    return [summary, *(f"{t.nodeid}: {t.message}" for t in tests if t.outcome != "passed")]


CLASSROOM_STATUS = {"passed": "pass", "timeout": "error", "error": "error"}  # else "fail"


def as_classroom(report: GradeReport) -> str:
    """The result GitHub Classroom's reporter (``autograding-grading-reporter``) reads from a
    runner step: one test per part, with its points, its status (``pass``, ``fail``, or
    ``error`` for a timeout or a broken run) and, as ``message``, the first failure's text.

    The reporter adds up the tests' ``score`` against the result's ``max_score``, prints each
    test's ``test_code`` (here: the command that runs the part's tests) and fails the job when
    the result's status is ``fail`` or ``error``.
    """
    tests = []
    for result in report.parts:
        summary, *failures = _outcome(result.tests, result.status, result.full_detail)
        phase, number = result.part.id.split(".")
        test_file = f"tests/test_phase{phase}.py"
        tests.append(
            {
                "name": f"{result.part.id} {result.part.title}",
                "status": CLASSROOM_STATUS.get(result.status, "fail"),
                "score": result.score,
                "max_score": result.part.points,
                "message": _clip("\n".join([summary, *failures[:1]])),
                "test_code": f"uv run pytest {test_file} -k part{number}_ -v",
                "filename": test_file,
                "line_no": 0,
                "execution_time": "",
            }
        )
    statuses = {test["status"] for test in tests}
    status = next((s for s in ("fail", "error") if s in statuses), "pass")
    document = {"version": 1, "status": status, "max_score": report.max_score, "tests": tests}
    return json.dumps(document, indent=2)


PIPED_WIDTH = 400  # columns for a table that no terminal wraps


def print_table(report: GradeReport, console: Console) -> None:
    """The grade as a table; piped or redirected, as wide as its rows (never cut to 80)."""
    table = Table(title="vkv grade")
    columns = ["part", "title", "tests passed", "status", "score"]
    if report.isolated is not None:
        columns.append("isolated score")
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("part", "title", "status") else "right"
        )
    isolated = report.isolated or [None] * len(report.parts)
    for result, alone in zip(report.parts, isolated, strict=True):
        color = {"passed": "green", "not started": "dim"}.get(result.status, "red")
        row = [
            result.part.id,
            result.part.title,
            f"{result.passed}/{result.total}",
            f"[{color}]{result.status}[/{color}]"
            + (f" ({escape(result.full_detail)})" if result.full_detail else ""),
            f"{result.score:g}/{result.part.points:g}",
        ]
        if alone is not None:
            row.append(f"{alone.score:g}/{alone.part.points:g}")
        table.add_row(*row)
    total = ["", "total", "", "", f"[bold]{report.score:g}/{report.max_score:g}"]
    if report.isolated is not None:
        total.append(f"[bold]{sum(r.score for r in report.isolated):g}/{report.max_score:g}")
    table.add_row(*total)
    if not console.is_terminal:
        console.width = PIPED_WIDTH  # no terminal wraps it: a piped table keeps its rows whole
    console.print(table)
    for result in report.parts:
        failing = [t.short_id for t in result.tests if t.outcome != "passed"]
        if failing and result.status != "not started":
            shown = ", ".join(failing[:FAILING_SHOWN])
            more = len(failing) - FAILING_SHOWN
            shown += f" and {more} more" if more > 0 else ""
            console.print(f"part {result.part.id} failing: {shown}", highlight=False)
    for path in report.protected_modified:
        console.print(f"[yellow]not graded: protected file modified: {path}[/yellow]")
    for reason in report.not_graded.values():
        console.print(f"[yellow]{reason}[/yellow]", highlight=False)
    line = escape(f"{_sandbox_line(report)}; {report.execution_time:.0f} s in all")
    console.print(f"[bold yellow]{line}[/bold yellow]" if report.progress_check else line)


def progress_line(result: PartResult, isolated: PartResult | None, elapsed: float) -> str:
    """One line of a grade under way, printed as a part's runs end: what the table's row will
    say, and the seconds since the grade began."""
    line = (
        f"part {result.part.id} {result.part.title}: {result.passed}/{result.total} passed, "
        f"{result.status}, {result.score:g}/{result.part.points:g}"
    )
    if isolated is not None:
        line += f" ({isolated.score:g} isolated)"
    return f"{line} [{elapsed:.0f} s]"


def _sandbox_line(report: GradeReport) -> str:
    """How the grade ran, with its seed; for a progress check, the note saying why it is one."""
    where = "in a bubblewrap sandbox" if report.sandboxed else "without a sandbox"
    line = f"graded {where}, seed {report.seed}"
    if not (report.progress_check and report.note):
        return line
    return f"{report.note[0].upper()}{report.note[1:]} ({line})"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_OUTPUT else text[: MAX_OUTPUT - 20] + "\n... (cut)"
