"""The static policy on submitted files (``vkv/assignment/policy.py``), rule by rule.

Each case puts a line of code in place of the stub of ``BlockAllocator.allocate`` (part 1.2) in
the student edition's ``block.py`` and expects the rule it breaks, on that line; the reference
solution of every editable file passes.
"""

from pathlib import Path

import pytest

from vkv.assignment.parts import Assignment
from vkv.assignment.policy import check_file
from vkv.assignment.regions import stub_regions

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = Assignment.load(ROOT)
BLOCK = "vkv/engine/block.py"
EDITION = stub_regions((ROOT / BLOCK).read_text(), set(ASSIGNMENT.part_ids), BLOCK)
STUB = '        raise NotImplementedError("part 1.2: BlockAllocator.allocate'


def with_body(code: str) -> tuple[bytes, int]:
    """The edition's block.py with ``code`` (indented for the method) in place of the stub."""
    lines = EDITION.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(STUB))
    lines[at] = "".join(f"        {line}\n" for line in code.splitlines())
    return "".join(lines).encode(), at + 1


@pytest.mark.parametrize("path", ASSIGNMENT.editable)
def test_the_reference_solution_passes_against_the_edition(path):
    reference = (ROOT / path).read_text()
    edition = stub_regions(reference, set(ASSIGNMENT.part_ids), path)
    assert check_file(path, reference.encode(), edition, ASSIGNMENT.policy) is None
    assert check_file(path, edition.encode(), edition, ASSIGNMENT.policy) is None


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        ("import os", "an import of os, which is not allowed here"),
        ("from collections import deque\nimport heapq", None),
        ("from vkv.engine.sequence import Sequence", None),
        ("from vkv.engine.scheduler import sys", "an import of the forbidden name sys"),
        ("from vkv.engine.llm_engine import Path", "an import of vkv.engine.llm_engine"),
        ("import vkv.engine.block\nreturn vkv", "an import of the forbidden name vkv"),
        ("from . import sequence", "a relative import"),
        ("from vkv import assignment", "an import of vkv, which is not allowed here"),
        ("return eval('1')", "the forbidden name eval"),
        ("return open('tests/hidden/x.py').read()", "the forbidden name open"),
        ("return getattr(self, 'free')", "the forbidden name getattr"),
        ("return type(self)", "the forbidden name type"),
        ("return self.blocks[0].sys", "the forbidden name sys"),
        ("return self.__class__", "the dunder name __class__"),
        ("return self._free_block_ids.f_back", "the forbidden attribute f_back"),
        ("return '{0.__globals__}'.format(len)", "a dunder name in a string"),
        ("return dict(__eq__=1)", "the dunder name __eq__"),
        ("class Anything:\n    pass", "a class definition"),
        ("global Block", "a global or nonlocal declaration"),
        ("def helper(x):\n    return x\nreturn helper(self.blocks[0])", None),
        ("raise SystemExit(0)", "the forbidden name SystemExit"),
    ],
)
def test_each_rule_names_itself_and_its_line(code, rule):
    data, line = with_body(code)
    violation = check_file(BLOCK, data, EDITION, ASSIGNMENT.policy)
    if rule is None:
        assert violation is None, violation
        return
    assert violation is not None and rule in violation.rule, violation
    assert line <= violation.line < line + len(code.splitlines()), violation
    said = str(violation)
    assert said.startswith("not graded: ") and f"at line {violation.line} of {BLOCK}" in said


def test_code_outside_the_regions_is_refused_at_its_line():
    lines = EDITION.splitlines(keepends=True)
    lines.insert(3, "import os\n")
    violation = check_file(BLOCK, "".join(lines).encode(), EDITION, ASSIGNMENT.policy)
    assert violation.rule == "code outside the solution regions changed" and violation.line == 4


def test_a_part_that_imports_a_module_may_name_it():
    from dataclasses import replace

    policy = replace(ASSIGNMENT.policy, part_imports=(("1.2", ("torch",)),))
    data, _ = with_body("import torch\nreturn torch.zeros(1)")
    assert check_file(BLOCK, data, EDITION, policy) is None
    assert check_file(BLOCK, data, EDITION, ASSIGNMENT.policy) is not None
    data, _ = with_body("import torch\nreturn torch.load('tests/hidden/test_phase1_hidden.py')")
    violation = check_file(BLOCK, data, EDITION, policy)
    assert violation is not None and "the forbidden attribute load" in violation.rule, violation
