"""The static policy on submitted files (``vkv/assignment/policy.py``), rule by rule.

Each case puts a line of code in place of the stub of ``BlockAllocator.allocate`` (part 1.2) in
the student edition's ``block.py`` and expects the rule it breaks, on that line; the reference
solution of every editable file passes.
"""

import json
from pathlib import Path

import pytest

from vkv.assignment.parts import Assignment
from vkv.assignment.policy import POLICY_TEST_SUFFIX, check_file, check_part
from vkv.assignment.regions import find_regions, rewrite_regions, stub_regions

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
    assert check_file(path, reference.encode(), edition, ASSIGNMENT.policy).first is None
    assert check_file(path, edition.encode(), edition, ASSIGNMENT.policy).first is None


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        # imports: listed modules only, and from them only names of the vocabulary
        ("import os", "an import of os, which is not allowed here"),
        ("from collections import deque\nimport heapq", None),
        ("from vkv.engine.sequence import Sequence", None),
        ("from vkv.engine.scheduler import sys", "an import of the name sys"),
        ("from vkv.config import os", "an import of the name os"),
        ("from collections import _sys", "an import of the name _sys"),
        ("from heapq import *", "an import of the name *"),
        # modules whose vocabulary is a list ([policy.modules]): the harmless names only
        ("import functools\nreturn functools.reduce(max, [1, 2], 0)", None),
        ("from functools import partial\nreturn partial(len)", None),
        ("from operator import itemgetter\nreturn sorted([(1, 2)], key=itemgetter(1))", None),
        ("import operator\nreturn operator.attrgetter('ref_count')", "the attribute `attrgetter`"),
        ("from operator import methodcaller", "an import of the name methodcaller"),
        ("import copy\nreturn copy.copy(self.blocks)", None),
        ("import copy\nreturn copy.dispatch_table", "the attribute `dispatch_table`"),
        ("from copy import dispatch_table", "an import of the name dispatch_table"),
        ("from typing import Optional\nbest: Optional[int] = None\nreturn best", None),
        ("def pick(n: int) -> int:\n    return n\nreturn pick(1)", None),
        ("import typing\nreturn typing.get_type_hints(len)", "the attribute `get_type_hints`"),
        ("squares = [lambda i=i: i * i for i in range(3)]\nreturn squares[0]()", None),
        ("from vkv.engine.llm_engine import Path", "an import of vkv.engine.llm_engine"),
        ("import vkv.engine.block\nreturn vkv", "the module vkv used as a value"),
        ("from . import sequence", "a relative import"),
        ("from vkv import assignment", "an import of vkv, which is not allowed here"),
        # names: locals, the module's given names, listed builtins
        ("return eval('1')", "`eval` is not allowed"),
        ("return open('tests/hidden/x.py')", "`open` is not allowed"),
        ("return getattr(self, 'free')", None),
        ("name = 'free'\nreturn getattr(self, name)", "getattr without a literal attribute name"),
        ("return getattr(self.blocks[0], 'nope')", "the attribute `nope` of an object other"),
        ("return hasattr(self, 'blocks')", None),
        ("return [hasattr(self, name) for name in ('blocks', 'device')]", None),  # a bool only
        ("return hasattr(self)", "hasattr with 1 arguments"),
        ("return type(self)", "type(...) as a value"),
        ("raise TypeError(f'got {type(self).__name__}')", None),
        ("kind = type\nreturn kind(self)", "type used as a value"),
        ("return super(BlockAllocator, self).allocate()", "super() used otherwise than"),
        ("return super().__init__()", "the dunder name __init__"),
        ("raise SystemExit(0)", "`SystemExit` is not allowed"),
        ("return dataclass", "`dataclass` is not allowed"),  # imported by block.py for itself
        ("import heapq\nh = heapq\nreturn h", "the module heapq used as a value"),
        ("queue = deque()\nqueue.append(len(self.blocks))\nprint(queue)", None),
        # attributes: anything on self; a public name of the vocabulary elsewhere
        ("self._ids = deque()\nreturn self._ids.popleft()", None),  # the class defines it
        ("return self._not_defined", "the private attribute _not_defined of self"),
        ("return self.not_a_known_name", "the attribute `not_a_known_name` of self"),
        ("import collections\nreturn collections._sys", "the private attribute _sys"),
        ("return self.blocks[0]._private", "the private attribute _private"),
        ("other = BlockAllocator(self.device, 1)\nother._check_owned(self.blocks[0])", None),
        ("from vkv.engine.swapper import _distinct_block_ids", None),  # given code defines it
        ("from vkv.engine.swapper import _private", "an import of the name _private"),
        ("return self.blocks[0].sys", "the forbidden attribute sys"),
        ("return self._free_block_ids.f_back", "the forbidden attribute f_back"),
        ("return self.blocks[0].whatever", "the attribute `whatever` of an object other than"),
        ("return self.__class__", "the dunder name __class__"),
        ("return '{} of {}'.format(1, len(self.blocks))", None),
        ("text = '{}'\nreturn text.format(len)", "the attribute format of an object other"),
        ("return '{}'.format_map({})", "the attribute format_map of"),
        ("return dict(__eq__=1)", "the dunder name __eq__"),
        # attribute assignment: on self, parameters, locals, what a call made
        ("self.blocks[0].ref_count = 1\nreturn self.blocks[0]", None),
        ("block = self.blocks[0]\nblock.ref_count = 1\nreturn block", None),
        ("Block.ref_count = 3", "setting an attribute of Block"),
        ("import heapq\nheapq.heappush = len", "setting an attribute of heapq"),
        ("deque.append = len", "setting an attribute of deque"),
        ("kind = Block\nkind.ref_count = 3", "setting an attribute of kind, bound to Block"),
        # strings
        ("return '{0.__globals__}'", "a dunder name in a string"),
        ("name = '_sys'\nreturn name", "a string that names a private attribute"),
        ("text = '{0.args[0]}'\nreturn text", "a format field with an attribute or an index"),
        ("return f'block {self.num_blocks}: {len(self.blocks)!r:>4}'", None),
        ("return f'vkv_{self.seq_id}_cache_usage_perc'", None),  # a piece names nothing
        # syntax: the reference's kinds, and the few listed additions
        ("class Anything:\n    pass", "a class definition is not allowed"),
        ("global Block", "a global declaration is not allowed"),
        ("match self:\n    case Block(ref_count=r):\n        return r", "a match statement"),
        ("yield 1", None),
        ("total = 0\ndef add(n):\n    nonlocal total\n    total += n", None),
        ("def helper(x):\n    return x\nreturn helper(self.blocks[0])", None),
        ("def helper(x, y=len):\n    return y(x)", None),
        ("def helper(x, y=open):\n    return y(x)", "`open` is not allowed"),
        ("return sorted(self.blocks, key=lambda b: b.block_id)[0]", None),
        ("return sorted(self.blocks, key=lambda b, f=len: f(b))", None),
        ("assert self.blocks, 'no blocks'\nwith self.blocks[0]:\n    pass", None),
        ("if (n := len(self.blocks)) > 0:\n    return {b: n for b in self.blocks}", None),
    ],
)
def test_each_rule_names_itself_and_its_line(code, rule):
    data, line = with_body(code)
    violation = check_file(BLOCK, data, EDITION, ASSIGNMENT.policy).first
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
    violation = check_file(BLOCK, "".join(lines).encode(), EDITION, ASSIGNMENT.policy).first
    assert violation.rule == "code outside the solution regions changed" and violation.line == 4


def test_a_part_that_imports_a_module_may_name_it():
    from dataclasses import replace

    policy = replace(
        ASSIGNMENT.policy,
        part_imports={"1.2": ("torch",)},
        part_attributes={"1.2": frozenset({"zeros"})},
    )
    data, _ = with_body("import torch\nreturn torch.zeros(1)")
    assert check_file(BLOCK, data, EDITION, policy).first is None
    assert check_file(BLOCK, data, EDITION, ASSIGNMENT.policy).first is not None
    data, _ = with_body("import torch\nreturn torch.load('tests/hidden/test_phase1_hidden.py')")
    violation = check_file(BLOCK, data, EDITION, policy).first
    assert violation is not None and "the forbidden attribute load" in violation.rule, violation


QUANTIZER = "vkv/engine/quantizer.py"
QUANTIZER_EDITION = stub_regions(
    (ROOT / QUANTIZER).read_text(), set(ASSIGNMENT.part_ids), QUANTIZER
)


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        ("return torch.zeros_like(codes).to(torch.uint8)", None),
        ("return torch.nn.functional.softmax(codes.float(), dim=-1).argmax(dim=-1)", None),
        ("import torch.nn.functional as F\nreturn F.pad(codes, (0, 1))", None),
        ("from torch.nn import functional\nreturn functional.softmax(codes, -1)", None),
        ("return torch.linalg.norm(codes.float()) + torch.sqrt(codes.float()).sum()", None),
        ("import math\nreturn torch.isqrt(codes)", "the attribute `isqrt` of the module torch"),
        ("with torch.no_grad():\n    return codes.amax(dim=-1, keepdim=True)", None),
        ("return torch.serialization", "the forbidden attribute serialization"),
        ("return torch._C", "the private attribute _C"),
        ("return torch.hub.os", "the forbidden attribute os"),
        ("return torch.testing", "the attribute `testing` of the module torch is not allowed"),
        ("return torch.fx", "the attribute `fx` of the module torch is not allowed"),
        ("torch.zeros = torch.ones", "setting an attribute of torch"),
        ("torch.equal = torch.eq", "setting an attribute of torch"),
        ("return codes.clamp_(0, 15).new_zeros(1).to(torch.bfloat16)", None),
        ("torch.Tensor.le = torch.Tensor.ge", "setting an attribute of torch"),
        ("kind = torch.Tensor\nkind.le = kind.ge", "setting an attribute of kind, bound to torch"),
        ("t = torch\nreturn t.zeros(1)", "the module torch used as a value"),
    ],
)
def test_a_part_that_imports_torch_reaches_only_the_listed_operations(code, rule):
    """``pack_int4`` (part 3.2) may use torch, through the part's ``attributes`` only."""
    stub = '    raise NotImplementedError("part 3.2: pack_int4'
    lines = QUANTIZER_EDITION.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(stub))
    lines[at] = "".join(f"    {line}\n" for line in code.splitlines())
    data = "".join(lines).encode()
    violation = check_file(QUANTIZER, data, QUANTIZER_EDITION, ASSIGNMENT.policy).first
    if rule is None:
        assert violation is None, violation
    else:
        assert violation is not None and rule in violation.rule, violation


def test_an_unknown_name_says_what_is_allowed():
    data, line = with_body("return frobnicate(self)")
    said = str(check_file(BLOCK, data, EDITION, ASSIGNMENT.policy).first)
    rule = "`frobnicate` is not allowed in the region of part 1.2"
    assert said.startswith(f"not graded: {rule} at line {line} of {BLOCK} (allowed: "), said
    allowed = said.split("(allowed: ", 1)[1]
    for name in ("self", "len", "Block", "deque", "NoFreeBlocksError"):
        assert name in allowed.split(", ") or f"{name}," in allowed, (name, allowed)


@pytest.mark.parametrize(
    "separator", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\r", "\r\n", "\x1c"]
)
def test_a_line_break_other_than_newline_is_refused(separator):
    """A comment holding a line break only ``str.splitlines`` sees: two readings of one file."""
    data, line = with_body("# a comment SEPARATOR return 1")
    data = data.replace(b" SEPARATOR ", separator.encode())
    violation = check_file(BLOCK, data, EDITION, ASSIGNMENT.policy).first
    assert violation is not None and "a line break other than \\n" in violation.rule, violation
    assert violation.line == line


def test_the_policy_lists_what_honest_code_needs():
    """The vocabulary holds the given classes' public names and the containers' methods, never
    ``format`` nor a forbidden attribute."""
    vocabulary = ASSIGNMENT.policy.vocabulary("2.2")
    for name in ("block_table", "num_computed_tokens", "append_token", "popleft", "setdefault"):
        assert name in vocabulary, name
    assert not vocabulary & (ASSIGNMENT.policy.forbidden_attributes | {"format", "format_map"})
    assert "amax" in ASSIGNMENT.policy.vocabulary("3.1") and "amax" not in vocabulary
    # per module: math's functions are math's, never a name on any object or on torch
    assert "sqrt" in ASSIGNMENT.policy.module_vocabulary("2.2", "math")
    assert "sqrt" not in vocabulary
    assert "isqrt" not in ASSIGNMENT.policy.module_vocabulary("3.1", "torch")


def test_each_part_begins_with_its_policy_test_which_the_grader_does_not_count():
    for part in ASSIGNMENT.parts:
        source = (ROOT / f"tests/test_phase{part.phase}.py").read_text()
        name = f"test_part{part.id.split('.')[1]}{POLICY_TEST_SUFFIX}"
        assert f'{name} = policy_test("{part.id}")' in source, name
    # not counted by vkv grade: tests/instructor/test_attacks_round3.py grades with them


HONEST = Path(__file__).parent / "honest"
CORPUS = [
    (corpus.stem, path, bodies)
    for corpus in sorted(HONEST.glob("*.json"))
    for path, bodies in json.loads(corpus.read_text()).items()
]


@pytest.mark.parametrize(
    ("corpus", "path", "bodies"), CORPUS, ids=[f"{c}/{p}" for c, p, _ in CORPUS]
)
def test_the_honest_corpus_is_admitted(corpus, path, bodies):
    """``honest/<phases>-<style>.json``: every part solved blind from the handouts and the
    stubs, by three students of different styles (plain; idiomatic: comprehensions, functools,
    generators, super(); defensive: getattr, type(x).__name__, str.format, typing, copy), kept
    as region bodies by their index in the file and put into today's edition. The policy
    refuses none of it, by ``vkv grade``'s check nor by each part's first test."""
    edition = stub_regions((ROOT / path).read_text(), set(ASSIGNMENT.part_ids), path)
    text = rewrite_regions(
        edition,
        lambda index, _: bodies[str(index)].split("\n") if str(index) in bodies else None,
        path,
    )
    assert check_file(path, text.encode(), edition, ASSIGNMENT.policy).first is None
    for part in {region.part for region in find_regions(text, path) if not region.is_stub}:
        assert check_part(path, text, part, ASSIGNMENT.policy).first is None
