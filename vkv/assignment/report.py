"""The forms a grade takes: a terminal table, JSON, Gradescope's results.json, Markdown.

The JSON form (``vkv-grade/1``) is what the auto-grading workflow passes from the unprivileged
job to the one that comments; that job validates it and renders the comment itself
(``comment.py``), so nothing a submission prints reaches a comment.
"""

import json

from rich.console import Console
from rich.table import Table

from vkv.assignment import comment
from vkv.assignment.grade import GradeReport, PartResult

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
    }
    if report.isolated is not None:
        document["isolated"] = [_part(result) for result in report.isolated]
        document["isolated_score"] = round(sum(r.score for r in report.isolated), 2)
    return document


def _part(result: PartResult) -> dict:
    return {
        "id": result.part.id,
        "title": result.part.title,
        "status": result.status,
        "detail": result.detail,
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
    return comment.as_markdown(comment.validate(as_dict(report), parts))


def as_gradescope(report: GradeReport) -> str:
    """Gradescope's ``results.json``: one entry per part, and one for its hidden tests if any.

    A part's points are split between its visible and hidden tests by their numbers; hidden
    entries are shown ``after_due_date``.
    """
    tests = []
    for result in report.parts:
        for hidden in (False, True):
            group = [t for t in result.tests if t.hidden is hidden]
            if not group:
                continue
            max_score = round(result.part.points * len(group) / result.total, 2)
            passed = sum(t.outcome == "passed" for t in group)
            failures = [f"{t.nodeid}: {t.message}" for t in group if t.outcome != "passed"]
            tests.append(
                {
                    "name": f"{result.part.id} {result.part.title}"
                    + (" (hidden tests)" if hidden else ""),
                    "number": result.part.id,
                    "score": round(max_score * passed / len(group), 2),
                    "max_score": max_score,
                    "status": "passed" if passed == len(group) else "failed",
                    "output": _clip(
                        f"{passed}/{len(group)} tests passed ({result.status}"
                        + (f": {result.detail}" if result.detail else "")
                        + ")\n"
                        + "\n".join(failures)
                    ),
                    "visibility": "after_due_date" if hidden else "visible",
                }
            )
    lines = [f"{path} sha256 {digest}" for path, digest in sorted(report.files.items())]
    lines += [f"not graded: protected file modified: {path}" for path in report.protected_modified]
    lines += list(report.not_graded.values())
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


def print_table(report: GradeReport, console: Console) -> None:
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
            + (f" ({result.detail})" if result.detail else ""),
            f"{result.score:g}/{result.part.points:g}",
        ]
        if alone is not None:
            row.append(f"{alone.score:g}/{alone.part.points:g}")
        table.add_row(*row)
    total = ["", "total", "", "", f"[bold]{report.score:g}/{report.max_score:g}"]
    if report.isolated is not None:
        total.append(f"[bold]{sum(r.score for r in report.isolated):g}/{report.max_score:g}")
    table.add_row(*total)
    console.print(table)
    for result in report.parts:
        failing = [t.nodeid.partition("::")[2] for t in result.tests if t.outcome != "passed"]
        if failing and result.status != "not started":
            shown = ", ".join(failing[:FAILING_SHOWN])
            more = len(failing) - FAILING_SHOWN
            shown += f" and {more} more" if more > 0 else ""
            console.print(f"part {result.part.id} failing: {shown}", highlight=False)
    for path in report.protected_modified:
        console.print(f"[yellow]not graded: protected file modified: {path}[/yellow]")
    for reason in report.not_graded.values():
        console.print(f"[yellow]{reason}[/yellow]", highlight=False)
    console.print(_sandbox_line(report), highlight=False)


def _sandbox_line(report: GradeReport) -> str:
    if report.sandboxed:
        return "graded in a bubblewrap sandbox"
    return "graded without a sandbox (no usable bubblewrap): the static policy only"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_OUTPUT else text[: MAX_OUTPUT - 20] + "\n... (cut)"
