"""The attacks of the grader's adversarial review, rebuilt against a fresh student edition.

Each one got full marks from the untouched stub edition before the static policy and the
sandbox existed. Each must now score no more than the honest 0 of the stub edition and be
flagged: first with the policy (the grade as instructors run it), then, where the attack is
more than code the policy refuses, with the policy off (``enforce_policy=False``) so that the
sandbox alone is shown to stop it. The sandboxed half needs bubblewrap: it is skipped where
bubblewrap cannot run, and fails instead when ``VKV_REQUIRE_SANDBOX=1`` (as in ``.ci/run``).
"""

import time
from pathlib import Path

import pytest

from vkv.assignment.grade import grade
from vkv.assignment.trees import copy_clean

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"1.1", "1.2"}
BLOCK = "vkv/engine/block.py"
OUTSIDE = "code outside the solution regions changed"


def stub_edition_with(edition: Path, where: Path, path: str, code: str) -> Path:
    """The untouched stub edition, with ``code`` appended to its file ``path``."""
    submission = where / "submission"
    copy_clean(edition, submission)
    target = submission / path
    target.write_text(target.read_text() + "\n" + code)
    return submission


def assert_refused(result, rule: str = OUTSIDE) -> None:
    """The policy flagged the file, and no part scored."""
    assert result.score == 0, [(p.part.id, p.score) for p in result.parts]
    assert any(rule in reason for reason in result.not_graded.values()), result.not_graded


def test_the_reference_scores_full_marks_in_the_sandbox(edition, bwrap):
    result = grade(ROOT, edition, parts=PARTS, require_sandbox=True)
    assert result.sandboxed and result.score == result.max_score == 30, result.parts


READ_THE_REFERENCE = """
import os, sys
def _reference():
    roots = list(sys.path)
    for entry in list(sys.path):
        try:
            for name in os.listdir(entry):
                if name.endswith(".pth"):
                    roots += open(os.path.join(entry, name)).read().split()
        except OSError:
            pass
    for root in roots:
        try:
            text = open(os.path.join(root, "vkv", "engine", "block.py")).read()
        except OSError:
            continue
        if 'NotImplementedError("part 1.2' not in text:
            return text
_found = _reference()
if _found:
    exec(compile(_found, "block.py", "exec"), globals())
"""


def test_1_the_reference_through_the_editable_install(edition, tmp_path, bwrap):
    submission = stub_edition_with(edition, tmp_path, BLOCK, READ_THE_REFERENCE)
    assert_refused(grade(submission, edition, parts=PARTS, timeout=30))
    alone = grade(submission, edition, parts=PARTS, timeout=30, enforce_policy=False)
    assert alone.sandboxed and alone.score == 0, "the sandbox shows no reference code"


READ_A_SIBLING_TREE = """
import glob, tempfile
for _path in glob.glob(tempfile.gettempdir() + "/vkv-grade-*/isolated-*/vkv/engine/block.py"):
    _text = open(_path).read()
    if 'NotImplementedError("part 1.2' not in _text:
        exec(compile(_text, "block.py", "exec"), globals())
        break
"""


def test_2_the_reference_in_a_sibling_isolated_tree(edition, tmp_path, bwrap):
    submission = stub_edition_with(edition, tmp_path, BLOCK, READ_A_SIBLING_TREE)
    result = grade(submission, edition, reference=ROOT, parts=PARTS, timeout=30)
    assert_refused(result)
    assert sum(part.score for part in result.isolated) == 0
    alone = grade(
        submission, edition, reference=ROOT, parts=PARTS, timeout=30, enforce_policy=False
    )
    assert alone.score == 0 and sum(part.score for part in alone.isolated) == 0, (
        "a sandboxed run sees its own tree only"
    )


PROFILE_HOOK = """
import sys
def _hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "pytest_runtest_call":
        item = frame.f_locals.get("item")
        if item is not None and hasattr(item, "_obj"):
            item._obj = lambda *args, **kwargs: None
sys.setprofile(_hook)
"""


def test_3_a_profile_hook_replaces_the_test_function(edition, tmp_path):
    submission = stub_edition_with(edition, tmp_path, BLOCK, PROFILE_HOOK)
    assert_refused(grade(submission, edition, parts=PARTS, timeout=30))
    alone = grade(submission, edition, parts=PARTS, timeout=30, enforce_policy=False)
    assert alone.score == 0
    assert all("tampered" in part.detail for part in alone.parts), [p.detail for p in alone.parts]


def test_4_a_region_dedented_to_class_level(edition, tmp_path):
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    block = submission / BLOCK
    lines = block.read_text().splitlines(keepends=True)
    stub = next(i for i, line in enumerate(lines) if "part 1.2: BlockAllocator.allocate" in line)
    lines[stub] = (
        '        pass\n    print("runs when the class body runs")\n'  # dedented: class level
    )
    block.write_text("".join(lines))
    result = grade(submission, edition, reference=ROOT, parts=PARTS, timeout=30)
    assert_refused(result, "a statement at class or module level in the region of part 1.2")
    assert sum(part.score for part in result.isolated) == 0


FORK_A_DAEMON = """
import os
if os.fork() == 0:
    os.setsid()
    os.execv("/bin/sleep", ["/bin/sleep", "{marker}"])
"""


def running_with(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(entry.name)
        except OSError:
            continue
    return found


def test_5_a_forked_daemon_is_gone_when_the_grade_returns(edition, tmp_path, bwrap):
    marker = f"{time.time() % 1000 + 1000:.3f}"  # sleep's argument: a name to find it by
    code = FORK_A_DAEMON.format(marker=marker)
    submission = stub_edition_with(edition, tmp_path, BLOCK, code)
    assert_refused(grade(submission, edition, parts=PARTS, timeout=30))
    alone = grade(submission, edition, parts=PARTS, timeout=30, enforce_policy=False)
    assert alone.sandboxed and alone.score == 0
    assert running_with(marker) == [], "a process a test forked outlived the grade"


WRITE_THE_TRUSTED_TREE = """
for _name in ("{trusted}/sitecustomize.py", "{output}"):
    try:
        open(_name, "w").write("import sys")
    except OSError:
        pass
"""


def test_5_no_write_reaches_the_trusted_tree_or_the_output(edition, tmp_path, bwrap):
    trusted = tmp_path / "trusted"
    copy_clean(edition, trusted)
    output = tmp_path / "results.json"
    output.write_text("{}")
    code = WRITE_THE_TRUSTED_TREE.format(trusted=trusted, output=output)
    submission = stub_edition_with(edition, tmp_path, BLOCK, code)
    alone = grade(submission, trusted, parts=PARTS, timeout=30, enforce_policy=False)
    assert alone.score == 0
    assert not (trusted / "sitecustomize.py").exists() and output.read_text() == "{}"


LEAK_THE_HIDDEN_TESTS = """
import glob
_hidden = "".join(open(p).read() for p in glob.glob("tests/hidden/*.py"))
"""


def test_6_no_visible_test_carries_the_hidden_tests(edition, tmp_path, bwrap):
    submission = stub_edition_with(edition, tmp_path, BLOCK, LEAK_THE_HIDDEN_TESTS)
    block = submission / BLOCK
    stub = 'raise NotImplementedError("part 1.2: BlockAllocator.__init__'
    block.write_text(block.read_text().replace(stub, f"raise ValueError(_hidden)  # {stub}", 1))
    hidden = ROOT / "tests/hidden"
    secret = next(
        line
        for line in (hidden / "test_phase1_hidden.py").read_text().splitlines()
        if line.startswith("def test_part")
    )
    assert_refused(grade(submission, edition, parts=PARTS, hidden=hidden, timeout=30))
    alone = grade(submission, edition, parts=PARTS, hidden=hidden, timeout=30, enforce_policy=False)
    visible = [t for part in alone.parts for t in part.tests if not t.hidden]
    assert visible and not any(secret in t.message for t in visible), "a hidden test leaked"


EQUAL_TO_EVERYTHING = """
class _Anything:
    def __eq__(self, other):
        return True
"""


def test_7_objects_equal_to_everything(edition, tmp_path):
    submission = stub_edition_with(edition, tmp_path, BLOCK, EQUAL_TO_EVERYTHING)
    block = submission / BLOCK
    text = block.read_text()
    stub = 'raise NotImplementedError("part 1.2: BlockAllocator.num_free_blocks'
    block.write_text(text.replace(stub, f"return _Anything()  # {stub}", 1))
    assert_refused(grade(submission, edition, parts=PARTS, timeout=30))
    inside = tmp_path / "inside"
    copy_clean(edition, inside)
    block = inside / BLOCK
    body = "class _Anything:\n            pass\n        return _Anything()  # "
    block.write_text(block.read_text().replace(stub, body + stub, 1))
    assert_refused(grade(inside, edition, parts=PARTS, timeout=30), "a class definition")


@pytest.mark.parametrize(
    ("damage", "rule"),
    [
        (lambda text: text.encode() + b"\n# \xff\xfe\n", "the file is not UTF-8 text"),
        (lambda text: (text + "\ndef broken(:\n").encode(), "a syntax error"),
    ],
    ids=["not UTF-8", "syntax error"],
)
def test_a_broken_file_scores_its_parts_0_with_the_reason(edition, tmp_path, damage, rule):
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    block = submission / BLOCK
    block.write_bytes(damage(block.read_text()))
    for result in (
        grade(submission, edition, parts=PARTS, timeout=30),
        grade(submission, edition, reference=ROOT, parts=PARTS, timeout=30),
    ):
        by_id = {part.part.id: part for part in result.parts}
        assert by_id["1.2"].status == "not graded" and rule in by_id["1.2"].detail
        assert by_id["1.1"].status == "not started", "sequence.py is graded as usual"
    assert {part.status for part in result.isolated} == {"not started", "not graded"}
