"""What a grade found: each test's outcome, each part's result and score, the whole report
(``grade.py`` makes them; ``report.py`` writes them for a terminal, GitHub Classroom and
Gradescope).

Scoring: a part's score is its points times the share of its tests that pass; with hidden
tests in the run, the lower of the visible and the hidden shares.
"""

from dataclasses import dataclass, field
from pathlib import Path

from vkv.assignment.parts import Part, part_of_test

HIDDEN_DIR = Path("tests") / "hidden"


@dataclass(slots=True, frozen=True)
class TestOutcome:
    """One test's result: ``passed``, ``failed``, ``timeout`` or ``missing`` (never reported)."""

    nodeid: str
    outcome: str
    message: str = ""

    @property
    def part(self) -> str | None:
        return part_of_nodeid(self.nodeid)

    @property
    def hidden(self) -> bool:
        return is_hidden(self.nodeid)

    @property
    def short_id(self) -> str:
        """The file's name and the test's, which name its phase and its part:
        ``test_phase2.py::test_part1_admits...`` is a test of part 2.1."""
        file, _, name = self.nodeid.partition("::")
        return f"{Path(file).name}::{name}"


RunResult = tuple[list[TestOutcome], str, str]  # one test process: outcomes, status, detail


def is_hidden(nodeid: str) -> bool:
    """Whether the test ``nodeid`` is one of the hidden tests (``tests/hidden/``)."""
    return nodeid.startswith(HIDDEN_DIR.as_posix() + "/")


def part_of_nodeid(nodeid: str) -> str | None:
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
    def shares(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(passed, total) of the visible tests, and of the hidden ones."""
        hidden = [test for test in self.tests if test.hidden]
        passed_hidden = sum(test.outcome == "passed" for test in hidden)
        visible = (self.passed - passed_hidden, self.total - len(hidden))
        return visible, (passed_hidden, len(hidden))

    @property
    def score(self) -> float:
        """Points times the share of tests passed; with hidden tests, the lower of the visible
        and the hidden shares."""
        shares = [passed / total for passed, total in self.shares if total]
        return round(self.part.points * min(shares), 2) if shares else 0.0

    @property
    def hidden_rule(self) -> str:
        """What the score rule did, when the hidden tests' share is the lower one; else ""."""
        (passed, total), (hidden_passed, hidden_total) = self.shares
        if not hidden_total or not total or hidden_passed * total >= passed * hidden_total:
            return ""
        return (
            f"hidden tests {hidden_passed}/{hidden_total} passed, visible {passed}/{total}: the "
            "score takes the lower share"
        )

    @property
    def full_detail(self) -> str:
        """``detail``, then ``hidden_rule``."""
        return "; ".join(text for text in (self.detail, self.hidden_rule) if text)


@dataclass(slots=True)
class GradeReport:
    """A grade. ``progress_check``: it is no grade (no sandbox, or a tree graded by its own
    tests), with ``note`` saying why; ``seed``: the ``VKV_GRADE_SEED`` every test process got."""

    parts: list[PartResult]
    protected_modified: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # graded file -> sha256
    not_graded: dict[str, str] = field(default_factory=dict)  # file -> the policy's reasons
    isolated: list[PartResult] | None = None
    sandboxed: bool = False
    progress_check: bool = True
    note: str = ""
    seed: int = 0
    execution_time: float = 0.0

    @property
    def score(self) -> float:
        return round(sum(p.score for p in self.parts), 2)

    @property
    def max_score(self) -> float:
        return sum(p.part.points for p in self.parts)
