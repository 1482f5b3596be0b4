"""``vkv grade``: run the graded tests of a tree and score each part from ``parts.toml``.

Scoring: a part's score is its points times the share of its tests that passed (partial
credit). A part with no test results (the test file failed to import, for example) scores 0.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.assignment.parts import Assignment, Part
from vkv.assignment.testrun import TestResult, run_tests


@dataclass(slots=True, frozen=True)
class PartScore:
    part: Part
    results: tuple[TestResult, ...]

    @property
    def passed(self) -> int:
        return sum(result.outcome == "passed" for result in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def score(self) -> float:
        return 0.0 if self.total == 0 else round(self.part.points * self.passed / self.total, 2)

    @property
    def status(self) -> str:
        if self.total == 0:
            return "error"
        return "passed" if self.passed == self.total else "failed"


def grade(root: Path) -> list[PartScore]:
    """Score every part of the assignment tree at ``root``."""
    assignment = Assignment.load(root)
    results = run_tests(root, assignment.test_files)
    return [
        PartScore(part, tuple(r for r in results if r.part == part.id)) for part in assignment.parts
    ]


def as_json(scores: list[PartScore]) -> str:
    document = {
        "score": round(sum(s.score for s in scores), 2),
        "max_score": sum(s.part.points for s in scores),
        "parts": [
            {
                "id": s.part.id,
                "title": s.part.title,
                "status": s.status,
                "score": s.score,
                "max_score": s.part.points,
                "passed": s.passed,
                "total": s.total,
                "failed_tests": [r.nodeid for r in s.results if r.outcome != "passed"],
            }
            for s in scores
        ],
    }
    return json.dumps(document, indent=2)


def print_table(scores: list[PartScore], console: Console) -> None:
    table = Table(title="vkv grade")
    for column in ("part", "title", "tests passed", "status", "score"):
        table.add_column(column, justify="right" if column in ("tests passed", "score") else "left")
    for s in scores:
        color = {"passed": "green", "failed": "red", "error": "red"}[s.status]
        table.add_row(
            s.part.id,
            s.part.title,
            f"{s.passed}/{s.total}",
            f"[{color}]{s.status}[/{color}]",
            f"{s.score:g}/{s.part.points:g}",
        )
    total = sum(s.score for s in scores)
    table.add_row("", "total", "", "", f"[bold]{total:g}/{sum(s.part.points for s in scores):g}")
    console.print(table)
