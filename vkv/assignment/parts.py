"""The assignment's manifest (``assignment/parts.toml``) and how tests map to parts.

A graded test belongs to the part named by its file and its name: the test
``tests/test_phase1.py::test_part3_free_returns_blocks`` belongs to part 1.3.
"""

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from vkv.assignment.policy import Policy

MANIFEST = Path("assignment") / "parts.toml"
GRADED_TEST_NAME = re.compile(r"^test_part(?P<number>\d+)_")
GRADED_TEST_FILE = re.compile(r"^test_phase(?P<phase>\d+)(_\w+)?\.py$")


@dataclass(slots=True, frozen=True)
class Part:
    id: str
    title: str
    points: float
    depends_on: tuple[str, ...]

    @property
    def phase(self) -> int:
        return int(self.id.split(".")[0])


@dataclass(slots=True, frozen=True)
class Assignment:
    """The parsed manifest of the tree at ``root``.

    ``edition`` is ``"reference"`` in this repository and ``"student"`` in a released edition
    (``vkv assignment release`` sets it): a student edition has no reference code to isolate,
    solve or check with.
    """

    root: Path
    parts: tuple[Part, ...]
    editable: tuple[str, ...]
    release_exclude: tuple[str, ...]
    edition: str = "reference"
    policy: Policy = field(default_factory=Policy)

    @classmethod
    def load(cls, root: Path) -> "Assignment":
        path = root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{root} is not an assignment tree: {MANIFEST} is missing")
        data = tomllib.loads(path.read_text())
        parts = tuple(
            Part(p["id"], p["title"], float(p["points"]), tuple(p.get("depends_on", [])))
            for p in data.get("part", [])
        )
        known = {part.id for part in parts}
        for part in parts:
            unknown = set(part.depends_on) - known
            if unknown:
                raise ValueError(f"{path}: part {part.id} depends on unknown parts {unknown}")
        settings = data.get("assignment", {})
        edition = settings.get("edition", "reference")
        if edition not in ("reference", "student"):
            raise ValueError(f"{path}: edition must be reference or student, got {edition!r}")
        return cls(
            root,
            parts,
            tuple(settings.get("editable", [])),
            tuple(settings.get("release_exclude", [])),
            edition,
            Policy.from_manifest(data, root),
        )

    def restricted_to(self, part_ids: set[str]) -> "Assignment":
        """The same assignment with only the given parts (``KeyError`` for an unknown one)."""
        for part_id in part_ids:
            self.part(part_id)
        kept = tuple(part for part in self.parts if part.id in part_ids)
        return replace(self, parts=kept)

    def part(self, part_id: str) -> Part:
        for part in self.parts:
            if part.id == part_id:
                return part
        raise KeyError(f"no part {part_id!r}; parts are {', '.join(self.part_ids)}")

    @property
    def part_ids(self) -> list[str]:
        return [part.id for part in self.parts]

    @property
    def test_files(self) -> list[str]:
        """The graded test files, one per phase that has parts."""
        phases = sorted({part.phase for part in self.parts})
        return [f"tests/test_phase{phase}.py" for phase in phases]

    def dependents(self, part_id: str) -> set[str]:
        """Parts that depend on ``part_id``, directly or through other parts."""
        found: set[str] = set()
        frontier = {part_id}
        while frontier:
            frontier = {p.id for p in self.parts if set(p.depends_on) & frontier} - found
            found |= frontier
        return found

    def prerequisites(self, part_id: str) -> set[str]:
        """Parts that ``part_id`` depends on, directly or through other parts."""
        found: set[str] = set()
        frontier = set(self.part(part_id).depends_on)
        while frontier:
            found |= frontier
            frontier = {d for p in frontier for d in self.part(p).depends_on} - found
        return found

    def expand(self, selection: str) -> set[str]:
        """Parse ``1.1,1.3`` or a whole phase ``1`` or ``all`` into a set of part ids."""
        chosen: set[str] = set()
        for item in filter(None, (s.strip() for s in selection.split(","))):
            if item == "all":
                chosen.update(self.part_ids)
            elif "." in item:
                chosen.add(self.part(item).id)
            else:
                in_phase = {p.id for p in self.parts if str(p.phase) == item}
                if not in_phase:
                    raise KeyError(f"no part or phase {item!r}; parts are {self.part_ids}")
                chosen |= in_phase
        return chosen


def part_of_test(file_name: str, test_name: str) -> str | None:
    """The part a graded test belongs to, or None for a test that is not graded."""
    file_match = GRADED_TEST_FILE.match(file_name)
    name_match = GRADED_TEST_NAME.match(test_name)
    if not (file_match and name_match):
        return None
    return f"{file_match['phase']}.{name_match['number']}"
