"""Round 3 of the grader's adversarial review: names trusted by spelling, a checker that could be
crashed or stalled, failure messages that carried source, tests that left things behind.

The attack classes, each with the tests that failed on the policy and the grader before this
round and pass after (the held-out attacks themselves stay outside this repository):

a. ``self`` re-bound (an import alias, an assignment, a lambda or nested-def parameter, a
   ``for``/``with``/``except``/comprehension target, a walrus), after which any attribute on it
   passed: every form is refused, and the part alone scores 0;
b. a region that crashes the parser (``RecursionError``, ``MemoryError``): a refusal with a
   message, and the grade still writes its report;
c. a long policy-clean region: the check is linear in its size (counted, not timed), and a
   region past ``MAX_REGION_NODES`` is refused;
d. a failure message carrying the hidden test's source (the traceback's lines): a hidden test
   shows one line, a visible one what it asserted;
e. a file and a daemon left by one test for the next: each test has a scratch folder of its
   own, and what it started is killed after it.

And the other side of the same policy: a refusal costs its own part only, and the honest idioms
the round's probe found refused (``super()``, ``torch.nn.functional``...) are admitted.
"""

import ast
import json
from pathlib import Path

import pytest
from test_attacks_round2 import in_regions, submission_with

from vkv.assignment import report
from vkv.assignment.grade import grade
from vkv.assignment.parts import Assignment
from vkv.assignment.policy import POLICY_TEST_SUFFIX, check_file
from vkv.assignment.region_check import MAX_REGION_NODES

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = Assignment.load(ROOT)
BLOCK = "vkv/engine/block.py"
BLOCK_MANAGER = "vkv/engine/block_manager.py"
ALLOCATE = "BlockAllocator.allocate"
TIMEOUT = 60


def verdict_of(edition: Path, path: str, bodies: dict[str, str]):
    text = (edition / path).read_text()
    return check_file(path, in_regions(text, path, bodies).encode(), text, ASSIGNMENT.policy)


# ---- a. self re-bound ------------------------------------------------------------------------

REBINDINGS = {
    "an import alias": "import collections as self\nreturn self._sys",
    "an assignment": "self = self.blocks\nreturn self.anything",
    "a lambda parameter": "reach = lambda self: self._private\nreturn reach(len)",
    "a nested def parameter": "def reach(self):\n    return self.whatever\nreturn reach(len)",
    "a for target": "for self in [len]:\n    return self.anything",
    "a with target": "with self.blocks[0] as self:\n    return self.anything",
    "an except name": "try:\n    pass\nexcept ValueError as self:\n    return self.anything",
    "a comprehension target": "return [self.anything for self in [len]]",
    "a walrus": "if (self := len):\n    return self.anything",
    "a nonlocal": "def inner():\n    nonlocal self\n    self = len\ninner()",
    "a del": "del self",
}


@pytest.mark.parametrize("code", REBINDINGS.values(), ids=REBINDINGS.keys())
def test_a_region_that_rebinds_self_is_refused(edition, code):
    verdict = verdict_of(edition, BLOCK, {ALLOCATE: code})
    assert verdict.whole_file is None and set(verdict.regions) == {"1.2"}, verdict
    assert "binding the name self" in verdict.regions["1.2"].rule, verdict


def test_on_self_only_what_its_class_defines(edition):
    """Attributes on a trusted ``self``: the class's own (its methods' ``self.x = ...``, the
    region's among them), the public vocabulary; never a private name nobody defined."""
    assert not verdict_of(edition, BLOCK, {ALLOCATE: "self._mine = 1\nreturn self._mine"}).regions
    refused = verdict_of(edition, BLOCK, {ALLOCATE: "return self._sys"}).regions["1.2"]
    assert "the private attribute _sys of self" in refused.rule
    refused = verdict_of(edition, BLOCK, {ALLOCATE: "return self.f_globals"}).regions["1.2"]
    assert "forbidden attribute f_globals" in refused.rule


def test_a_rebound_self_forges_nothing_and_costs_its_part_only(edition, tmp_path):
    """The forging class end to end: the region that re-binds ``self`` is graded as its stub
    (part 1.4: 0, not graded), the file's other part (1.3) is graded as submitted."""
    attack = "import collections as self\nreturn self._sys.modules"
    submission = submission_with(
        edition,
        tmp_path,
        {BLOCK_MANAGER: {"BlockManager.swap_out": attack}},
        solved={"1.1", "1.2", "1.3", "1.4", "1.5"},
    )
    result = grade(submission, edition, parts={"1.3", "1.4"}, timeout=TIMEOUT)
    by_part = {p.part.id: p for p in result.parts}
    assert by_part["1.4"].status == "not graded" and by_part["1.4"].score == 0
    assert "binding the name self" in by_part["1.4"].detail
    assert by_part["1.3"].score == by_part["1.3"].part.points, by_part["1.3"]
    assert "binding the name self" in result.not_graded[BLOCK_MANAGER]


# ---- b. a region that crashes the parser -----------------------------------------------------

CRASHES = {
    "RecursionError": "return 1" + " + 1" * 200_000,
    "MemoryError": "return " + "-" * 200_000 + "1",
}


@pytest.mark.parametrize("code", CRASHES.values(), ids=CRASHES.keys())
def test_a_region_that_crashes_the_parser_is_refused(edition, code):
    verdict = verdict_of(edition, BLOCK, {ALLOCATE: code})
    assert verdict.whole_file is not None, verdict
    assert "too deeply nested to check" in verdict.whole_file.rule


def test_a_grade_of_a_parser_crash_writes_its_report(edition, tmp_path):
    submission = submission_with(
        edition, tmp_path, {BLOCK: {ALLOCATE: CRASHES["RecursionError"]}}, solved={"1.1"}
    )
    result = grade(submission, edition, parts={"1.1", "1.2"}, timeout=TIMEOUT)
    document = json.loads(json.dumps(report.as_dict(result)))
    by_part = {p["id"]: p for p in document["parts"]}
    assert by_part["1.1"]["score"] == 10 and by_part["1.2"]["status"] == "not graded"
    assert "too deeply nested" in by_part["1.2"]["detail"]


# ---- c. a long region: linear, and bounded ---------------------------------------------------


def visits(edition: Path, statements: int, monkeypatch) -> int:
    """How many nodes the check visits for a region of ``statements`` attribute stores (each
    store once sent the old check over the whole function again)."""
    counted = [0]
    walk_children = ast.iter_child_nodes

    def counting(node):
        counted[0] += 1
        return walk_children(node)

    code = "block = self.blocks[0]\n" + "block.ref_count = 1\n" * statements + "return block"
    monkeypatch.setattr(ast, "iter_child_nodes", counting)
    verdict = verdict_of(edition, BLOCK, {ALLOCATE: code})
    monkeypatch.setattr(ast, "iter_child_nodes", walk_children)
    assert verdict.first is None, verdict
    return counted[0]


def test_the_check_is_linear_in_the_regions_size(edition, monkeypatch):
    small, large = visits(edition, 200, monkeypatch), visits(edition, 800, monkeypatch)
    assert large < 4.5 * small, f"4x the statements cost {large / small:.1f}x the visits"


def test_a_region_past_the_node_limit_is_refused(edition):
    code = "total = 0\n" + "total += 1\n" * (MAX_REGION_NODES // 2) + "return total"
    verdict = verdict_of(edition, BLOCK, {ALLOCATE: code})
    assert f"at most {MAX_REGION_NODES}" in str(verdict.regions["1.2"]), verdict


# ---- d. what a failure shows -----------------------------------------------------------------

LEAKY_HIDDEN = """
def test_part1_hidden_assertion():
    secret = "HIDDEN-SOURCE-LINE"
    assert secret == "x", f"{secret} in an assertion message"


def test_part1_hidden_raises():
    raise ValueError("HIDDEN-SOURCE-LINE in an exception")
"""


def test_a_hidden_failure_shows_one_line_and_no_source(edition, tmp_path, bwrap):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_phase1_leaky.py").write_text(LEAKY_HIDDEN)
    submission = submission_with(edition, tmp_path, {}, solved={"1.1"})
    result = grade(submission, edition, parts={"1.1"}, hidden=hidden, timeout=TIMEOUT)
    shown = {t.nodeid.partition("::")[2]: t.message for t in result.parts[0].tests if t.hidden}
    assert shown == {
        "test_part1_hidden_assertion": "a hidden assertion failed",
        "test_part1_hidden_raises": "ValueError raised",
    }
    for text in (json.dumps(report.as_dict(result)), report.as_gradescope(result)):
        assert "HIDDEN-SOURCE-LINE" not in text


def test_a_visible_failure_shows_what_it_asserted_never_the_traceback(edition, tmp_path):
    wrong = "return None"  # Block allocation that hands out nothing
    submission = submission_with(edition, tmp_path, {BLOCK: {ALLOCATE: wrong}}, solved={"1.1"})
    result = grade(submission, edition, parts={"1.2"}, timeout=TIMEOUT)
    failed = [t for t in result.parts[0].tests if t.outcome != "passed"]
    assert failed, result.parts[0]
    for test in failed:
        assert "def test_" not in test.message and "    " not in test.message.split("\n")[0]
        assert "tests/test_phase1.py:" not in test.message, test.message


# ---- e. nothing of a test reaches the next ---------------------------------------------------

LEFT_BEHIND = """
import os
import subprocess
import sys
import tempfile

MARKER = "vkv-left-behind-" + os.environ["VKV_GRADE_SEED"]


def places():
    # the test's own temporary folder, and in the sandbox /tmp itself
    return [tempfile.gettempdir()] + (["/tmp"] if os.environ.get("CHECK_SLASH_TMP") else [])


def test_part1_a_leaves_a_file_and_a_daemon():
    for place in places():
        with open(os.path.join(place, MARKER), "w") as out:
            out.write("left")
    code = "import time; time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code, MARKER], start_new_session=True)


def test_part1_b_finds_nothing_left():
    assert not [p for p in places() if os.path.exists(os.path.join(p, MARKER))]
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARKER.encode() in f.read():
                    alive.append(pid)
        except OSError:
            pass
    assert not alive, f"a daemon of the previous test is alive: {alive}"
"""


@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandboxed"])
def test_a_test_finds_nothing_a_previous_test_left(edition, tmp_path, request, sandboxed):
    if sandboxed:
        request.getfixturevalue("bwrap")
    else:
        request.getfixturevalue("no_sandbox")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    source = LEFT_BEHIND.replace('os.environ.get("CHECK_SLASH_TMP")', str(sandboxed))
    (hidden / "test_phase1_left.py").write_text(source)
    submission = submission_with(edition, tmp_path, {}, solved={"1.1"})
    result = grade(
        submission,
        edition,
        parts={"1.1"},
        hidden=hidden,
        timeout=TIMEOUT,
        unsafe_no_sandbox=not sandboxed,
        seed=int.from_bytes(tmp_path.name.encode()[-4:], "big"),
    )
    hidden_tests = {
        t.nodeid.partition("::")[2]: (t.outcome, t.message)
        for t in result.parts[0].tests
        if t.hidden
    }
    assert hidden_tests["test_part1_b_finds_nothing_left"][0] == "passed", hidden_tests


# ---- the other side: honest idioms are graded as they run ------------------------------------

HONEST_IDIOMS = {  # (file, the reference's line, the same written another honest way)
    "4.8": (
        "vkv/engine/prefix_caching.py",
        "        BlockManager.free(self, seq)\n",
        "        super().free(seq)\n",
    ),
    "3.6": (
        "vkv/kernels/quantized.py",
        "    weights = torch.softmax(scores, dim=-1)\n",
        "    weights = torch.nn.functional.softmax(scores, dim=-1)\n",
    ),
}


@pytest.mark.parametrize("part", HONEST_IDIOMS)
def test_an_honest_idiom_scores_full_points(edition, tmp_path, part):
    """The round's two honest submissions: ``super().free(seq)`` in part 4.8 and
    ``torch.nn.functional.softmax`` in part 3.6 pass their part's first test (the policy) and
    score the part's full points."""
    path, line, honest_line = HONEST_IDIOMS[part]
    submission = submission_with(edition, tmp_path, {}, solved=set(ASSIGNMENT.part_ids))
    text = (submission / path).read_text()
    assert text.count(line) == 1, f"the reference's line moved: {line!r}"
    (submission / path).write_text(text.replace(line, honest_line))
    result = grade(submission, edition, parts={part}, timeout=TIMEOUT)
    (graded,) = result.parts
    assert graded.score == graded.part.points, (graded.status, graded.detail)
    counted = [test.nodeid for test in graded.tests]
    assert counted and not [nodeid for nodeid in counted if POLICY_TEST_SUFFIX in nodeid]
