"""Round 2 of the grader's adversarial review: attacks from inside the solution regions.

Round 1 (``test_attacks.py``) appended its attacks outside the regions, where the old policy
already refuses any change. These attacks sit where a student may write: each replaces a stub
line of a fresh student edition with code at the region's indentation (``in_regions``), so
they test the checks made *on* region code, and the layers behind them. The attack classes,
one or a few tests each (the letter is the issue's):

a. ``sys`` through a private alias an allowlisted module keeps (``collections._sys``), then
   forged ``passed`` records for every test id on the report pipe and ``os._exit(0)``;
b. a ``match`` statement whose class pattern reaches a function's globals;
c. a line break other than ``\\n`` in a comment, shifting ``splitlines`` line numbers away from
   the parser's to hide code from the region checks;
d. the same in a comment that a rebuild through ``splitlines`` (an isolated tree) would turn
   into real code;
e. ``open`` reached as an attribute chain of ``torch`` (Phase 3 may import torch);
f. torch's comparisons patched (``torch.equal = lambda *a, **k: True``) with regions that
   return zeros;
g. ``str.format`` fields that walk from a caught exception to the caller's frame;
h. a table of the visible tests' inputs and outputs, against hidden tests drawn per grade;
i. malformed report records written to the pipe;
j. files outside the regions: conftest, ``.pth``, a symbolic link, the manifest, a test file;
k. the editable files deleted;
l. grading hidden tests without bubblewrap, a daemon and a probe, the trusted tree rewritten.

Each attack must score 0 and be flagged with the policy on (plain and, with the reference,
isolated); where a layer behind the policy should stop it too, a second test grades it with
``enforce_policy=False``, in the sandbox (skipped without bubblewrap, failed instead under
``VKV_REQUIRE_SANDBOX=1``). Sweeps of an attack's variants go through ``check_file`` (the
policy alone, in milliseconds); every class is also graded end to end.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from vkv.assignment import report
from vkv.assignment.grade import grade
from vkv.assignment.parts import Assignment
from vkv.assignment.policy import check_file
from vkv.assignment.regions import rewrite_regions
from vkv.assignment.release import solve
from vkv.assignment.trees import copy_clean

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = Assignment.load(ROOT)
BLOCK = "vkv/engine/block.py"
SEQUENCE = "vkv/engine/sequence.py"
QUANTIZER = "vkv/engine/quantizer.py"
HIDDEN = ROOT / "tests/hidden"
TIMEOUT = 60


# ---- building and grading submissions ------------------------------------------------------


def in_regions(text: str, path: str, bodies: dict[str, str]) -> str:
    """``text`` with the region of each function named in ``bodies`` (by qualified name)
    holding that code instead, each line indented like the region. Lines split on ``\\n``
    only, so that any other line break in the code stays where it is written."""

    def replace(_: int, region) -> list[str] | None:
        code = bodies.get(region.qualname)
        if code is None:
            return None
        return [region.indent + line if line else "" for line in code.split("\n")]

    return rewrite_regions(text, replace, path)


def submission_with(
    edition: Path,
    where: Path,
    files: dict[str, dict[str, str]],
    solved: set[str] = frozenset(),
) -> Path:
    """A fresh copy of the edition, with the reference's code for the parts ``solved``, then
    each file of ``files`` given the region bodies it maps to (``in_regions``)."""
    submission = where / "submission"
    copy_clean(edition, submission)
    if solved:
        solve(ROOT, submission, set(solved))
    for path, bodies in files.items():
        target = submission / path
        target.write_bytes(in_regions(target.read_text(), path, bodies).encode())
    return submission


def assert_refused_in_region(edition: Path, path: str, bodies: dict[str, str]) -> None:
    """The policy alone refuses the edition's ``path`` with those region bodies, for a rule
    their code breaks (not a syntax error of the attack, not a change outside the regions)."""
    text = (edition / path).read_text()
    verdict = check_file(path, in_regions(text, path, bodies).encode(), text, ASSIGNMENT.policy)
    violation = verdict.first
    assert violation is not None, "the policy lets the attack through"
    assert "in the region of part" in str(violation), str(violation)


def scores(result) -> dict[str, object]:
    """What a failed assertion shows: each part's score, status, detail and failing tests."""

    def shown(part) -> tuple[object, ...]:
        failing = [t.nodeid.partition("::")[2] for t in part.tests if t.outcome != "passed"]
        return part.score, part.status, part.detail[:200], failing[:5]

    said: dict[str, object] = {p.part.id: shown(p) for p in result.parts}
    if result.isolated is not None:
        said["isolated"] = {p.part.id: shown(p) for p in result.isolated}
    said["not_graded"] = result.not_graded
    return said


def isolated_score(result) -> float:
    return sum(part.score for part in result.isolated or ())


def assert_not_graded(result, path: str, rule: str | None = None) -> None:
    """The policy flagged ``path`` (for the rule matching the regular expression ``rule``, if
    given), and nothing scored, plain or isolated."""
    assert result.score == 0 and isolated_score(result) == 0, scores(result)
    reason = result.not_graded.get(path, "")
    assert reason.startswith("not graded:") and "syntax error" not in reason, scores(result)
    if rule is not None:
        assert re.search(rule, reason.removesuffix(f" of {path}")), reason


def refused(submission: Path, edition: Path, parts: set[str], path: str, rule=None):
    """Grade with the policy on, plain and isolated; the file must be refused."""
    result = grade(submission, edition, reference=ROOT, parts=parts, timeout=TIMEOUT)
    assert_not_graded(result, path, rule)
    return result


def part_result(result, part: str):
    return next(p for p in result.parts if p.part.id == part)


def test_the_reference_scores_full_marks_as_the_attacks_are_graded(edition, bwrap):
    """The control: a grade that gives the reference full marks, plain and isolated, with the
    policy off, so that an attack's 0 below is the attack's and not a broken grader's (the
    honest half of ``test_h`` is Phase 3's control)."""
    result = grade(
        ROOT, edition, reference=ROOT, parts={"1.1", "1.2"}, timeout=TIMEOUT, enforce_policy=False
    )
    assert result.sandboxed and not result.progress_check
    assert result.score == isolated_score(result) == result.max_score == 30, scores(result)


# ---- the payload shared by the forging attacks ---------------------------------------------

# With ``s`` bound to the ``sys`` module: forge a ``passed`` record for every test id in
# ``sys.argv`` and in the graded test files, then ``finished``, on every pipe, and leave
# before the reporter writes anything true. Names only what the old policy allowed.
FORGE = r"""o = s.modules["os"]
j = s.modules["json"]
ids = [a for a in s.argv if "::" in a]
for name in ("tests/test_phase1.py", "tests/test_phase3.py"):
    for line in s.modules["linecache"].getlines(name):
        if line.startswith("def test_part"):
            ids.append(name + "::" + line[4:].partition("(")[0])
lines = []
for i in ids:
    for w in ("setup", "call", "teardown"):
        lines.append(j.dumps({"nodeid": i, "when": w, "outcome": "passed", "message": ""}))
lines.append(j.dumps({"event": "finished", "tampered": None}))
for fd in o.listdir("/proc/self/fd"):
    try:
        if o.readlink("/proc/self/fd/" + fd).startswith("pipe:"):
            o.write(int(fd), ("\n".join(lines) + "\n").encode())
    except OSError:
        pass
o._exit(0)"""


# ---- a. sys through a private alias of an allowed module -----------------------------------

PRIVATE_SYS = {
    "collections._sys": "import collections\ns = collections._sys",
    "from collections import _sys": "from collections import _sys as s",
    "collections._collections_abc": "import collections\ns = collections._collections_abc.sys",
}


@pytest.mark.parametrize("reach", PRIVATE_SYS.values(), ids=PRIVATE_SYS.keys())
def test_a_the_policy_refuses_a_private_alias_of_sys(edition, reach):
    bodies = {"Sequence.__init__": reach + "\n" + FORGE}
    assert_refused_in_region(edition, SEQUENCE, bodies)


def test_a_forged_records_through_collections_sys_are_refused(edition, tmp_path):
    bodies = {"Sequence.__init__": PRIVATE_SYS["collections._sys"] + "\n" + FORGE}
    submission = submission_with(edition, tmp_path, {SEQUENCE: bodies})
    refused(submission, edition, {"1.1"}, SEQUENCE)


def test_a_forged_records_count_for_nothing_without_the_policy(edition, tmp_path, bwrap):
    """Each test in its own process: records for other tests are the forgery's tell."""
    bodies = {"Sequence.__init__": PRIVATE_SYS["collections._sys"] + "\n" + FORGE}
    submission = submission_with(edition, tmp_path, {SEQUENCE: bodies})
    alone = grade(submission, edition, parts={"1.1"}, timeout=TIMEOUT, enforce_policy=False)
    assert alone.sandboxed and part_result(alone, "1.1").score == 0, scores(alone)


# ---- b. a match statement reaching a function's globals ------------------------------------

MATCH_GLOBALS = (
    "def probe():\n"
    "    return None\n"
    "match probe:\n"
    "    case object(__globals__=g):\n"
    '        b = g["_" * 2 + "builtins" + "_" * 2]\n'
    '        s = b["_" * 2 + "import" + "_" * 2]("sys")\n'
)
MATCHES = {
    "class pattern, dunder keyword": MATCH_GLOBALS + FORGE,
    "class pattern, plain keyword": "match self:\n    case object(real=r):\n        return r",
    "literal pattern": "match block_size:\n    case 1:\n        pass",
}


@pytest.mark.parametrize("code", MATCHES.values(), ids=MATCHES.keys())
def test_b_the_policy_refuses_every_match_statement(edition, code):
    assert_refused_in_region(edition, SEQUENCE, {"Sequence.__init__": code})


def test_b_a_match_class_pattern_reaching_globals_is_refused(edition, tmp_path):
    bodies = {"Sequence.__init__": MATCH_GLOBALS + FORGE}
    submission = submission_with(edition, tmp_path, {SEQUENCE: bodies})
    refused(submission, edition, {"1.1"}, SEQUENCE)


# ---- c, d. line breaks other than \n -------------------------------------------------------

SEPARATORS = {
    "U+2028": "\u2028",
    "U+2029": "\u2029",
    "U+0085": "\x85",
    "VT": "\x0b",
    "FF": "\x0c",
    "lone CR": "\r",
}
LINE_BREAK = r"line (break|separator|ending)"  # the rule, however it is worded
UNFINISHED = 'raise NotImplementedError("part 1.2: BlockAllocator, to do")'  # no dunder string
STUB_12 = 'raise NotImplementedError("part 1.2: BlockAllocator.{} — assignment/phase1.md#part-2")'


@pytest.mark.parametrize("separator", SEPARATORS.values(), ids=SEPARATORS.keys())
def test_c_a_line_break_in_a_comment_hides_no_code(edition, tmp_path, separator):
    """One break in a comment of ``num_blocks``'s region moves every later line number that
    ``splitlines`` gives one away from the parser's: the next region's first line, which
    imports ``os``, falls out of the lines the region checks look at."""
    submission = submission_with(edition, tmp_path, {BLOCK: shifted_by(separator)})
    refused(submission, edition, {"1.2"}, BLOCK, rule=LINE_BREAK)


def shifted_by(separator: str) -> dict[str, str]:
    return {
        "BlockAllocator.num_blocks": f"# the pool{separator}# never shrinks\n"
        "return len(self.blocks)",
        "BlockAllocator.num_free_blocks": "import os; return os.cpu_count()",
    }


# The forgery on one line, for a comment: every test id of ``sys.argv`` passed, on every pipe.
FORGE_LINE = (
    "import json, os, sys; [os.write(int(fd), (''.join(json.dumps({'nodeid': a, 'when': 'call', "
    "'outcome': 'passed', 'message': ''}) + '\\n' for a in sys.argv if '::' in a) + json.dumps("
    "{'event': 'finished', 'tampered': None}) + '\\n').encode()) for fd in os.listdir("
    "'/proc/self/fd') if os.path.lexists('/proc/self/fd/' + fd) and os.readlink("
    "'/proc/self/fd/' + fd).startswith('pipe:')]; os._exit(0)"
)


def broken_into_code(separator: str) -> dict[str, str]:
    """A comment that a rebuild through ``splitlines`` turns into the forgery's line."""
    comment = f"# see phase1.md{separator}{' ' * 8}{FORGE_LINE}"
    return {"BlockAllocator.__init__": comment + "\n" + UNFINISHED}


@pytest.mark.parametrize(
    "separator", [s for s in SEPARATORS.values() if s != "\r"], ids=list(SEPARATORS)[:-1]
)
def test_d_a_comment_a_rebuild_would_break_into_code_is_refused(edition, tmp_path, separator):
    """Code after the break is a comment to the parser, a real line once a rebuild through
    ``splitlines`` turns the break into ``\\n``: it would run in isolated trees only."""
    submission = submission_with(edition, tmp_path, {BLOCK: broken_into_code(separator)})
    refused(submission, edition, {"1.2"}, BLOCK, rule=LINE_BREAK)


def test_d_isolated_trees_never_break_a_comment_into_code(edition, tmp_path):
    """With the policy off, the isolated tree is rebuilt on ``\\n`` only: still a comment."""
    submission = submission_with(edition, tmp_path, {BLOCK: broken_into_code("\u2028")})
    alone = grade(
        submission, edition, reference=ROOT, parts={"1.2"}, timeout=TIMEOUT, enforce_policy=False
    )
    assert alone.score == 0 and isolated_score(alone) == 0, scores(alone)


# ---- e. open as an attribute chain of torch ------------------------------------------------

OPENERS = {  # each: a callable (path, mode) -> a file object; FLAGS: os.open's flags by mode
    "a private class": "lambda name, mode: torch.serialization._open_file(name, mode).file_like",
    "a public-looking chain": "torch.serialization.tarfile.bltn_open",
    "torch.os": "lambda name, mode: torch.os.fdopen(torch.os.open(name, FLAGS[mode]), mode)",
    "torch.hub": "lambda name, mode: "
    "torch.hub.os.fdopen(torch.hub.os.open(name, FLAGS[mode]), mode)",
    "torch.utils": "lambda name, mode: "
    "torch.utils.collect_env.os.fdopen(torch.utils.collect_env.os.open(name, FLAGS[mode]), mode)",
    "torch._C": "torch._C.PyTorchFileReader",
}
READ_AND_FORGE = r"""FLAGS = {{"r": 0, "a": 1025}}  # O_RDONLY; O_WRONLY | O_APPEND
f = {opener}
ids = []
for line in f("tests/test_phase3.py", "r").read().split("\n"):
    if line.startswith("def test_part"):
        ids.append("tests/test_phase3.py::" + line[4:].partition("(")[0])
record = '{{"nodeid": "%s", "when": "call", "outcome": "passed", "message": ""}}\n'
forged = "".join(record % i for i in ids) + '{{"event": "finished", "tampered": null}}\n'
for n in range(3, 64):
    try:
        with f("/proc/self/fd/%d" % n, "a") as out:
            out.write(forged)
    except OSError:
        pass
return codes"""


@pytest.mark.parametrize("opener", OPENERS.values(), ids=OPENERS.keys())
def test_e_the_policy_refuses_every_way_to_open_through_torch(edition, opener):
    bodies = {"pack_int4": READ_AND_FORGE.format(opener=opener)}
    assert_refused_in_region(edition, QUANTIZER, bodies)


def test_e_reading_the_tests_through_a_public_looking_torch_chain_is_refused(edition, tmp_path):
    opener = OPENERS["a public-looking chain"]
    bodies = {"pack_int4": READ_AND_FORGE.format(opener=opener)}
    submission = submission_with(edition, tmp_path, {QUANTIZER: bodies})
    refused(submission, edition, {"3.2"}, QUANTIZER)


# ---- f. torch's comparisons patched --------------------------------------------------------

PATCHES = {
    "torch.equal": "torch.equal = lambda *a, **k: True",
    "torch.allclose": "torch.allclose = lambda *a, **k: True",
    "torch.Tensor.eq": "torch.Tensor.eq = lambda *a, **k: True",
    "through a name": "t = torch.Tensor\nt.le = lambda *a, **k: True",
}
ZEROS = {
    "pack_int4": "return torch.zeros(*codes.shape[:-1], codes.shape[-1] // 2, dtype=torch.uint8)",
    "unpack_int4": (
        "return torch.zeros(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)"
    ),
}
ALWAYS_EQUAL = {**ZEROS, "pack_int4": "\n".join([*PATCHES.values(), ZEROS["pack_int4"]])}


@pytest.mark.parametrize("patch", PATCHES.values(), ids=PATCHES.keys())
def test_f_the_policy_refuses_assigning_to_torch(edition, patch):
    bodies = {**ZEROS, "pack_int4": patch + "\n" + ZEROS["pack_int4"]}
    assert_refused_in_region(edition, QUANTIZER, bodies)


def test_f_patched_comparisons_are_refused(edition, tmp_path):
    submission = submission_with(edition, tmp_path, {QUANTIZER: ALWAYS_EQUAL})
    refused(submission, edition, {"3.2"}, QUANTIZER)


def test_f_patched_comparisons_score_nothing_without_the_policy(edition, tmp_path, bwrap):
    """The guard checks torch after every test; the tests bound their comparisons first."""
    submission = submission_with(edition, tmp_path, {QUANTIZER: ALWAYS_EQUAL})
    alone = grade(submission, edition, parts={"3.2"}, timeout=TIMEOUT, enforce_policy=False)
    assert alone.sandboxed and alone.score == 0, scores(alone)


# ---- g. str.format walking to the caller's frame -------------------------------------------


def caller_local(name: str, dunder: bool = True) -> str:
    """A body that returns the caller's local ``name``, read through a format field (its
    dunder written out, or split so that no string constant holds one)."""
    walk = f"tb_frame.f_back.f_locals[{name}]}}"
    field = f'"{{0.__traceback__.{walk}"' if dunder else f'("{{0._" + "_traceback_" + "_.{walk}")'
    return (
        "try:\n    raise ValueError(self)\n"
        f"except ValueError as e:\n    return int({field}.format(e))"
    )


FORMATS = {
    "dunder field": caller_local("expected_blocks"),
    "split dunder field": caller_local("expected_blocks", dunder=False),
    "no dunder": "try:\n    raise ValueError(1)\nexcept ValueError as e:\n"
    '    return int("{0.args[0]}".format(e))',
}
PEEK = {
    "Sequence.num_blocks": caller_local("expected_blocks", dunder=False),
    "Sequence.last_block_num_tokens": caller_local("expected_last", dunder=False),
}


@pytest.mark.parametrize("code", FORMATS.values(), ids=FORMATS.keys())
def test_g_the_policy_refuses_format_fields(edition, code):
    assert_refused_in_region(edition, SEQUENCE, {"Sequence.num_blocks": code})


def test_g_reading_the_expected_value_from_the_callers_frame_is_refused(edition, tmp_path):
    submission = submission_with(edition, tmp_path, {SEQUENCE: PEEK}, solved={"1.1"})
    refused(submission, edition, {"1.1"}, SEQUENCE)


# ---- h. a table of the visible tests' inputs -----------------------------------------------

TABLE = {
    "pack_int4": """\
table = {
    ((1, 6), (1, 2, 15, 0, 7, 9)): [[0x01, 0x72, 0x9F]],
    ((1, 16), tuple(range(16))): [[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7]],
}
key = (tuple(codes.shape), tuple(codes.flatten().tolist()))
if key in table:
    return torch.tensor(table[key], dtype=torch.uint8)
return torch.zeros(*codes.shape[:-1], codes.shape[-1] // 2, dtype=torch.uint8)""",
    "unpack_int4": """\
table = {
    ((2, 2), (0x21, 0x0F, 0xF0, 0x5A)): [[1, 15, 2, 0], [0, 10, 15, 5]],
    ((1, 8), (0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7)): [list(range(16))],
}
key = (tuple(packed.shape), tuple(packed.flatten().tolist()))
if key in table:
    return torch.tensor(table[key], dtype=torch.uint8)
return torch.zeros(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)""",
}


def test_h_a_table_of_the_visible_inputs_keeps_little(edition, tmp_path, bwrap):
    """Hidden inputs are drawn per grade and a part scores min(visible, hidden share)."""
    options = dict(parts={"3.2"}, hidden=HIDDEN, timeout=TIMEOUT, require_sandbox=True)
    table = submission_with(edition, tmp_path / "table", {QUANTIZER: TABLE}, solved={"3.1"})
    honest = submission_with(edition, tmp_path / "honest", {}, solved={"3.1", "3.2"})
    cheat = part_result(grade(table, edition, **options), "3.2")
    fair = part_result(grade(honest, edition, **options), "3.2")
    assert fair.score == fair.part.points, ("honest code scores full marks", fair)
    assert cheat.score <= 0.1 * cheat.part.points and cheat.score < fair.score, (
        cheat.score,
        fair.score,
        [(t.nodeid, t.outcome) for t in cheat.tests],
    )


# ---- i. malformed report records -----------------------------------------------------------

SEND_ONCE = r"""import os
if "VKV_ROUND2_SENT" not in os.environ:
    os.environ["VKV_ROUND2_SENT"] = "1"
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink("/proc/self/fd/" + fd).startswith("pipe:"):
                os.write(int(fd), {record!r})
        except OSError:
            pass
""" + STUB_12.format("__init__")
A_TEST = "tests/test_phase1.py::test_part2_pool_starts_with_every_block_free"
MALFORMED = {
    "a list as test id": json.dumps(
        {"nodeid": [A_TEST], "when": "call", "outcome": "passed", "message": ""}
    ).encode()
    + b"\n",
    "a dict as message": json.dumps(
        {"nodeid": A_TEST, "when": "call", "outcome": "failed", "message": {"text": "x"}}
    ).encode()
    + b"\n",
    "bad UTF-8": b'{"nodeid": "' + A_TEST.encode() + b'\xff\xfe", "when": "call"}\n',
}


@pytest.mark.parametrize("record", MALFORMED.values(), ids=MALFORMED.keys())
def test_i_a_malformed_record_is_reported_not_raised(edition, tmp_path, record):
    bodies = {"BlockAllocator.__init__": SEND_ONCE.format(record=record)}
    submission = submission_with(edition, tmp_path, {BLOCK: bodies})
    result = grade(submission, edition, parts={"1.2"}, timeout=TIMEOUT, enforce_policy=False)
    part = part_result(result, "1.2")
    assert part.score == 0 and part.status != "not started" and part.detail, (
        "the run that wrote a malformed record is flagged",
        scores(result),
    )


# ---- j, k. files outside the regions, editable files deleted -------------------------------

CONFTEST = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def add_conftest(sub: Path) -> list[str]:
    for path in ("conftest.py", "tests/conftest.py"):
        (sub / path).write_text(CONFTEST)
    return ["conftest.py", "tests/conftest.py"]


def add_pth(sub: Path) -> list[str]:
    (sub / "vkv-round2.pth").write_text("import os; os.environ['VKV_ROUND2'] = '1'\n")
    return ["vkv-round2.pth"]


def link_the_reference(sub: Path) -> list[str]:
    (sub / BLOCK).unlink()
    (sub / BLOCK).symlink_to(ROOT / BLOCK)
    return [f"{BLOCK} (symbolic link)"]


def rewrite_the_manifest(sub: Path) -> list[str]:
    manifest = sub / "assignment/parts.toml"
    text = manifest.read_text().replace("editable = [", 'editable = [\n    "tests/test_phase1.py",')
    manifest.write_text(text.replace("points = 20", "points = 2000"))
    return ["assignment/parts.toml"]


def rewrite_the_tests(sub: Path) -> list[str]:
    names = ["pool_starts_with_every_block_free", "freed_block_can_be_allocated_again"]
    (sub / "tests/test_phase1.py").write_text(
        "".join(f"def test_part2_{name}():\n    pass\n\n\n" for name in names)
    )
    return ["tests/test_phase1.py"]


OUTSIDE = {
    "conftest, .pth, manifest and test file": (
        add_conftest,
        add_pth,
        rewrite_the_manifest,
        rewrite_the_tests,
    ),
    "symbolic link to the reference": (link_the_reference,),
}


@pytest.mark.parametrize("changes", OUTSIDE.values(), ids=OUTSIDE.keys())
def test_j_files_outside_the_regions_score_nothing(edition, tmp_path, changes):
    submission = submission_with(edition, tmp_path, {})
    reported = [path for change in changes for path in change(submission)]
    result = grade(submission, edition, reference=ROOT, parts={"1.2"}, timeout=TIMEOUT)
    assert result.score == 0 and isolated_score(result) == 0, scores(result)
    assert set(reported) <= set(result.protected_modified), result.protected_modified


def test_k_deleted_editable_files_score_nothing_plain_or_isolated(edition, tmp_path):
    """An isolated tree keeps the edition's stubs for a missing file, never the reference."""
    submission = submission_with(edition, tmp_path, {})
    for path in ASSIGNMENT.editable:
        (submission / path).unlink()
    result = grade(submission, edition, reference=ROOT, parts={"1.2"}, timeout=TIMEOUT)
    assert result.score == 0 and isolated_score(result) == 0, scores(result)


# ---- l. no bubblewrap: a progress check, never a grade -------------------------------------

DAEMON_AND_PROBE = """import os
if not os.path.exists({flag!r}):
    os.close(os.open({flag!r}, os.O_CREAT | os.O_WRONLY))
    if os.fork() == 0:
        os.setsid()
        os.execv("/bin/sleep", ["/bin/sleep", {marker!r}])
readable = [p for p in ({reference!r}, os.path.expanduser("~")) if os.access(p, os.R_OK)]
raise ValueError("without a sandbox a test reads " + repr(readable))"""
WRITE_TRUSTED = "open({target!r}, 'a').write('# x')\n" + STUB_12.format("__init__")


def sleeping_with(marker: str) -> list[int]:
    """The processes running ``/bin/sleep <marker>``: the daemon, and nothing else."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "cmdline").read_bytes() == f"/bin/sleep\0{marker}\0".encode():
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_l_hidden_tests_without_a_sandbox_are_refused(edition, no_sandbox):
    with pytest.raises(RuntimeError, match="sandbox"):
        grade(edition, edition, parts={"1.2"}, hidden=HIDDEN, timeout=TIMEOUT)


def test_l_an_unsandboxed_grade_says_it_is_a_progress_check(edition, tmp_path, no_sandbox):
    marker = f"{time.time() % 1000 + 2000:.3f}"  # sleep's argument: a name to find it by
    code = DAEMON_AND_PROBE.format(
        flag=str(tmp_path / "daemon-started"), marker=marker, reference=str(ROOT / BLOCK)
    )
    submission = submission_with(edition, tmp_path, {BLOCK: {"BlockAllocator.__init__": code}})
    try:
        result = grade(
            submission,
            edition,
            parts={"1.2"},
            hidden=HIDDEN,
            timeout=TIMEOUT,
            enforce_policy=False,
            unsafe_no_sandbox=True,
        )
    finally:
        for pid in sleeping_with(marker):  # the daemon this test's submission started
            os.kill(pid, signal.SIGKILL)
    assert result.progress_check and not result.sandboxed
    assert "progress check" in report.as_json(result).lower()
    assert "progress check" in report.as_gradescope(result).lower()


def test_l_rewriting_the_trusted_tree_still_voids_the_grade(edition, tmp_path, no_sandbox):
    trusted = tmp_path / "trusted"
    copy_clean(edition, trusted)
    target = trusted / ".venv/lib/sitecustomize.py"
    target.parent.mkdir(parents=True)
    target.write_text("")
    code = WRITE_TRUSTED.format(target=str(target))
    submission = submission_with(trusted, tmp_path, {BLOCK: {"BlockAllocator.__init__": code}})
    with pytest.raises(RuntimeError, match="trusted tree"):
        grade(
            submission,
            trusted,
            parts={"1.2"},
            hidden=HIDDEN,
            timeout=TIMEOUT,
            enforce_policy=False,
            unsafe_no_sandbox=True,
        )
