"""The grading policy as each part's first test: a student meets a refusal in pytest, at once.

``vkv grade`` checks every solution region against a static policy before it runs anything
(``vkv/assignment/policy.py``: what a region may import, name and reach), and grades a refused
region as its stub. ``policy_test("1.3")`` is that same check of part 1.3's regions in this
tree, as a test of the part: it fails with the grader's own message ("not graded: ... at line N
of FILE (allowed: ...)"), and while the part is still its stub it fails as the stub does.
"""

from functools import cache
from pathlib import Path

from vkv.assignment.parts import Assignment
from vkv.assignment.policy import check_part
from vkv.assignment.regions import find_regions

ROOT = Path(__file__).resolve().parents[1]


@cache
def _assignment() -> Assignment:
    return Assignment.load(ROOT)


def policy_test(part: str):
    """A test that part ``part``'s regions follow the grading policy."""

    def test() -> None:
        assignment = _assignment()
        checked = 0
        for path in assignment.editable:
            text = (ROOT / path).read_text(encoding="utf-8")
            own = [region for region in find_regions(text, path) if region.part == part]
            if not own:
                continue
            if all(region.is_stub for region in own):
                raise NotImplementedError(f"part {part}: its region is still the stub")
            verdict = check_part(path, text, part, assignment.policy)
            assert verdict.first is None, str(verdict.first)
            checked += 1
        assert checked, f"part {part} has no solution region in the editable files"

    test.__doc__ = f"Part {part}'s regions follow the grading policy (what vkv grade checks)."
    return test
