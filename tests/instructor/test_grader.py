"""``vkv grade`` against submissions that try to cheat, and its output formats.

Each cheat starts from an honest submission (Part 1.1 solved, Part 1.2 not) and must score no
more than it. Only parts 1.1 and 1.2 are graded, to keep each grade to a few seconds. Code
outside a solution region is refused by the static policy before it runs; such cheats are
graded a second time with ``enforce_policy=False`` (and, where a test says so, without the
sandbox), so that the guard behind the policy is tested on its own. ``test_attacks.py`` has
the attacks of the grader's adversarial review.
"""

import ast
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import threading
import zipfile
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from vkv import cli
from vkv.assignment import comment, report, results, sandbox
from vkv.assignment import grade as grade_module
from vkv.assignment.grade import grade
from vkv.assignment.parts import Assignment
from vkv.assignment.release import solve
from vkv.assignment.results import GradeReport, PartResult
from vkv.assignment.run_report import read_report
from vkv.assignment.trees import copy_clean

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"1.1", "1.2"}
SCHEMA = json.loads((Path(__file__).parent / "gradescope_schema.json").read_text())


@pytest.fixture(scope="module")
def honest_score(edition, tmp_path_factory) -> float:
    submission = honest(edition, tmp_path_factory.mktemp("honest"))
    return grade(submission, edition, parts=PARTS).score


def honest(edition: Path, where: Path) -> Path:
    submission = where / "submission"
    copy_clean(edition, submission)
    solve(ROOT, submission, {"1.1"})
    return submission


def cheat_score(
    edition: Path, where: Path, cheat, timeout: float = 60, **options
) -> tuple[float, object]:
    submission = honest(edition, where)
    cheat(submission)
    result = grade(submission, edition, parts=PARTS, timeout=timeout, **options)
    return result.score, result


def guarded_score(edition: Path, where: Path, cheat) -> tuple[float, object]:
    """The cheat graded twice: refused by the policy, then caught by what lies behind it."""
    _, result = cheat_score(edition, where / "policy", cheat)
    assert result.parts[1].status == "not graded", result.parts[1]
    assert "code outside the solution regions changed" in result.parts[1].detail
    return cheat_score(edition, where / "guard", cheat, enforce_policy=False)


def prepend(path: Path, code: str) -> None:
    path.write_text(code + "\n" + path.read_text())


def test_honest_submission_scores_part_1_1_only(honest_score):
    assert honest_score == 10


def test_modified_test_file_is_ignored_and_reported(edition, tmp_path, honest_score):
    def cheat(sub: Path) -> None:
        tests = sub / "tests/test_phase1.py"
        tests.write_text(tests.read_text().replace("assert ", "assert True or "))

    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score
    assert "tests/test_phase1.py" in result.protected_modified


def test_added_conftest_is_ignored(edition, tmp_path, honest_score):
    def cheat(sub: Path) -> None:
        (sub / "tests/conftest.py").write_text(
            "import pytest\n\n"
            "@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n"
            "    outcome.get_result().outcome = 'passed'\n"
        )

    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score and "tests/conftest.py" in result.protected_modified


def test_pytest11_entry_point_is_ignored(edition, tmp_path, honest_score):
    def cheat(sub: Path) -> None:
        pyproject = sub / "pyproject.toml"
        pyproject.write_text(
            pyproject.read_text() + '\n[project.entry-points.pytest11]\ncheat = "vkv.cheat"\n'
        )
        (sub / "vkv/cheat.py").write_text(
            "def pytest_runtest_logreport(report):\n    report.outcome = 'passed'\n"
        )

    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score
    assert {"pyproject.toml", "vkv/cheat.py"} <= set(result.protected_modified)


def test_os_exit_at_import_of_a_graded_module_scores_nothing(edition, tmp_path, honest_score):
    score, result = guarded_score(
        edition,
        tmp_path,
        lambda sub: prepend(sub / "vkv/engine/block.py", "import os\nos._exit(0)"),
    )
    assert score <= honest_score and score == 0
    assert {p.status for p in result.parts} == {"error"}


def replace_stub(qualname: str, code: str):
    """A cheat that puts ``code`` in place of the stub of ``BlockAllocator.<qualname>``."""

    def cheat(sub: Path) -> None:
        block = sub / "vkv/engine/block.py"
        stub = f'raise NotImplementedError("part 1.2: BlockAllocator.{qualname}'
        block.write_text(block.read_text().replace(stub, f"{code}  # {stub}", 1))

    return cheat


def test_sys_exit_inside_a_graded_function_is_not_graded(edition, tmp_path, honest_score):
    cheat = replace_stub("allocate", "import sys; sys.exit(0)")
    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score
    assert "an import of sys, which is not allowed here" in result.parts[1].detail


def test_raising_system_exit_inside_a_graded_function_fails_that_test(
    edition, tmp_path, honest_score
):
    cheat = replace_stub("allocate", "raise SystemExit(0)")
    score, result = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    assert score <= honest_score and result.parts[1].status != "passed"


def test_infinite_loop_times_out(edition, tmp_path, honest_score):
    cheat = replace_stub("__init__", "while True: pass")
    score, result = cheat_score(edition, tmp_path, cheat, timeout=15)
    assert score <= honest_score
    assert result.parts[1].status == "timeout"
    classroom = json.loads(report.as_classroom(result))
    assert classroom["tests"][1]["status"] == "error", "Classroom's reporter shows its message"
    assert "killed after 15 s" in classroom["tests"][1]["message"]


def test_fake_results_files_are_ignored(edition, tmp_path, honest_score):
    fake = (
        "import json, os, pathlib\n"
        "for name in ('results.json', 'junit.xml', 'report.jsonl'):\n"
        "    try:\n"
        "        pathlib.Path(name).write_text(json.dumps({'score': 1000}))\n"
        "    except OSError:\n"
        "        pass\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, json.dumps({'event': 'finished', 'tampered': None}).encode())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    score, _ = guarded_score(edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", fake))
    assert score <= honest_score


def test_monkeypatching_pytest_from_a_graded_module_is_detected(edition, tmp_path, honest_score):
    patch = "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
    score, result = guarded_score(
        edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", patch)
    )
    assert score <= honest_score and score == 0
    assert all("tampered" in p.detail for p in result.parts)


def test_patching_the_graders_reporter_is_detected(edition, tmp_path, honest_score):
    patch = (
        "import sys\n"
        "r = sys.modules.get('vkv.assignment.reporter')\n"
        "if r:\n"
        "    w = r.Reporter.write\n"
        "    r.Reporter.write = lambda self, rec: w(self, dict(rec, outcome='passed'))\n"
    )
    score, _ = guarded_score(edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", patch))
    assert score <= honest_score


def test_patching_hypothesis_is_detected(edition, tmp_path, honest_score):
    patch = (
        "import hypothesis.core as hc\n"
        "hc.StateForActualGivenExecution.run_engine = "
        "lambda self: setattr(self, 'ever_executed', True)\n"
    )
    score, _ = guarded_score(edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", patch))
    assert score <= honest_score


def test_patching_a_hook_instance_is_detected(edition, tmp_path, honest_score):
    patch = (
        "import gc\n"
        "import _pytest.config\n"
        "class P:\n"
        "    def __init__(s, h): s.h = h\n"
        "    def __getattr__(s, n): return getattr(s.h, n)\n"
        "    def __call__(s, session, **kw):\n"
        "        for it in session.items: it.runtest = lambda: None\n"
        "        return s.h(session=session, **kw)\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, _pytest.config.Config):\n"
        "        o.hook.pytest_collection_finish = P(o.hook.pytest_collection_finish)\n"
    )
    score, _ = guarded_score(edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", patch))
    assert score <= honest_score


def test_a_symlinked_folder_is_not_followed(edition, tmp_path, honest_score):
    def cheat(sub: Path) -> None:
        shutil.rmtree(sub / "vkv/engine")
        (sub / "vkv/engine").symlink_to(ROOT / "vkv/engine", target_is_directory=True)

    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score
    assert "vkv/engine (symbolic link)" in result.protected_modified


def test_writing_to_the_trusted_tree_voids_the_grade(edition, tmp_path_factory, no_sandbox):
    """Without the policy and without a sandbox, the digest of the trusted tree catches it."""
    trusted = tmp_path_factory.mktemp("trusted") / "edition"
    copy_clean(edition, trusted)
    submission = honest(trusted, tmp_path_factory.mktemp("poison"))
    target = trusted / ".venv/lib/sitecustomize.py"  # outside what the old digest read
    target.parent.mkdir(parents=True)
    target.write_text("")
    prepend(submission / "vkv/engine/block.py", f"open({str(target)!r}, 'a').write('# x')")
    with pytest.raises(RuntimeError, match="trusted tree") as raised:
        grade(submission, trusted, parts=PARTS, timeout=15, enforce_policy=False)
    assert "the first changed path: .venv/lib/sitecustomize.py" in str(raised.value)


def test_other_environments_linking_the_trusted_trees_cached_files_do_not_void_it(
    edition, tmp_path, tmp_path_factory, honest_score
):
    """uv hard-links a virtual environment's files to its shared cache: each environment made
    from that cache while a grade runs changes those files' ctime and link count, never the
    trusted tree. A grade must not be voided by another process's work."""
    trusted = tmp_path_factory.mktemp("trusted") / "edition"
    copy_clean(edition, trusted)
    cached = tmp_path_factory.mktemp("uv-cache") / "act"
    cached.write_text("#!/bin/sh\n")
    (trusted / ".venv/bin").mkdir(parents=True)
    os.link(cached, trusted / ".venv/bin/act")
    elsewhere = tmp_path_factory.mktemp("other-environment") / "act"
    done = threading.Event()

    def link_and_unlink() -> None:
        while not done.wait(0.005):
            os.link(cached, elsewhere)
            os.unlink(elsewhere)

    linker = threading.Thread(target=link_and_unlink)
    linker.start()
    try:
        result = grade(honest(trusted, tmp_path), trusted, parts=PARTS, timeout=60)
    finally:
        done.set()
        linker.join()
    assert result.score == honest_score


def test_a_tree_graded_by_its_own_tests_is_never_void(edition, tmp_path, no_sandbox):
    """A student grading their own tree while their other commands write to it (a pytest
    cache, a new file, an edit): a progress check of what was read, not a void grade."""
    submission = honest(edition, tmp_path)
    writes = "".join(
        f"open({str(submission / name)!r}, 'a').write('# x')\n"
        for name in ("notes.txt", "tests/test_phase1.py", "vkv/engine/sequence.py")
    )
    prepend(submission / "vkv/engine/block.py", writes)
    result = grade(submission, parts=PARTS, timeout=60, enforce_policy=False)
    assert result.progress_check
    assert (submission / "notes.txt").read_text().startswith("# x")


def test_garbage_in_the_report_does_not_crash_the_grader(edition, tmp_path, honest_score):
    garbage = PIPES + (
        "for fd in pipes():\n    os.write(fd, b'1\\n\\xff\\n[]\\n{\"nodeid\": 3}\\n')\n"
    )
    score, _ = guarded_score(
        edition, tmp_path, lambda s: prepend(s / "vkv/engine/block.py", garbage)
    )
    assert score <= honest_score


PIPES = (  # the report's pipe: the reporter took its number out of the environment
    "import json, os, stat, sys\n"
    "def pipes():\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
    "                yield fd\n"
    "        except OSError:\n"
    "            pass\n"
)
FORGE = PIPES + (
    "for fd in pipes():\n"
    "    for a in sys.argv:\n"
    "        if '::' in a:\n"
    "            record = {'nodeid': a, 'when': 'call', 'outcome': 'passed', 'message': '',\n"
    "                      'flagged': None}\n"
    "            os.write(fd, json.dumps(record).encode() + b'\\n')\n"
    "    os.write(fd, json.dumps({'event': 'finished', 'tampered': None}).encode() + b'\\n')\n"
    "os._exit(0)\n"
)


def test_the_policy_stops_a_forged_report(edition, tmp_path, honest_score):
    cheat = lambda s: prepend(s / "vkv/engine/block.py", FORGE)  # noqa: E731
    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score and result.parts[1].status == "not graded"


@pytest.mark.xfail(
    strict=True,
    reason="residual risk: code at a graded module's top level runs in the pytest process when "
    "collection imports it, and can forge what that process writes; the static policy (a region "
    "is a function body) is what keeps such code from running",
)
def test_forging_the_report_at_import_of_a_graded_module(edition, tmp_path, honest_score):
    cheat = lambda s: prepend(s / "vkv/engine/block.py", FORGE)  # noqa: E731
    score, _ = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    assert score <= honest_score


def in_a_function(name: str, body: str) -> str:
    """Module-level code that defines ``name()`` running ``body`` (a region then calls it)."""
    return f"def {name}():\n" + "".join(f"    {line}\n" for line in body.splitlines())


FORGE_FOR_OTHERS = PIPES + in_a_function(
    "_forge",
    "import json, os, sys\n"
    "for target in [f'/proc/self/fd/{fd}' for fd in pipes()]:\n"
    "    try:\n"
    "        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)\n"
    "    except OSError:\n"
    "        continue\n"
    "    for a in sys.argv:\n"
    "        if '::' in a:\n"
    "            for when in ('setup', 'call', 'teardown'):\n"
    "                record = {'$report_type': 'TestReport', 'nodeid': a, 'when': when,\n"
    "                          'outcome': 'passed', 'longrepr': None, 'message': '',\n"
    "                          'flagged': None, 'location': [a, 0, a], 'keywords': {},\n"
    "                          'sections': [], 'duration': 0, 'user_properties': []}\n"
    "                try:\n"
    "                    os.write(fd, json.dumps(record).encode() + b'\\n')\n"
    "                except OSError:\n"
    "                    pass\n"
    "os._exit(0)\n",
)


def test_a_test_process_cannot_report_for_another_test(edition, tmp_path, honest_score):
    """A region (policy off) writes passing records for every test id through every pipe it
    finds in /proc/self/fd, then exits: the tests that ran it fail, flagged, and no other."""

    def cheat(sub: Path) -> None:
        prepend(sub / "vkv/engine/block.py", FORGE_FOR_OTHERS)
        replace_stub("__init__", "_forge()")(sub)

    score, result = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    assert score <= honest_score and result.parts[1].score == 0
    assert result.parts[1].status == "error"
    assert "the test process reported for another test" in result.parts[1].detail
    flagged = [t for t in result.parts[1].tests if "another test" in t.message]
    assert flagged and all(t.outcome == "failed" for t in flagged)


REACH_THE_PARENT = in_a_function(
    "_reach",
    "import os\n"
    "reached = []\n"
    "for name in ['mem', 'environ'] + [f'fd/{n}' for n in range(64)]:\n"
    "    try:\n"
    "        os.close(os.open(f'/proc/{os.getppid()}/{name}', os.O_RDONLY | os.O_NONBLOCK))\n"
    "        reached.append(name)\n"
    "    except OSError:\n"
    "        pass\n"
    "own = sorted(int(n) for n in os.listdir('/proc/self/fd'))\n"
    "raise ValueError(f'reached {reached} of the parent; own fds {own}')\n",
)


def test_a_test_process_reaches_no_file_of_the_parent(edition, tmp_path, bwrap):
    """In the sandbox (no capability), the non-dumpable parent's /proc entries are closed to
    its children, and a child holds only 0-2, its own pipe and what it opened itself."""

    def cheat(sub: Path) -> None:
        prepend(sub / "vkv/engine/block.py", REACH_THE_PARENT)
        replace_stub("__init__", "_reach()")(sub)

    _, result = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    messages = [t.message for t in result.parts[1].tests if "reached" in t.message]
    assert messages, [t.message[-300:] for t in result.parts[1].tests]
    assert all("reached [] of the parent" in m for m in messages), messages[0][-500:]
    assert all(re.search(r"own fds \[0, 1, 2, \d+(, \d+)?\]", m) for m in messages)


MALFORMED = in_a_function(
    "_malformed",
    "import os, stat\n"
    "lines = [b'{\"nodeid\": [1], \"when\": \"call\"}', b'\\xff\\xfe', b'1e999999',\n"
    '         b\'[\' * 100000, b\'{"$report_type": "TestReport", "nodeid": {}}\']\n'
    "for fd in range(3, 64):\n"
    "    try:\n"
    "        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
    "            os.write(fd, b'\\n'.join(lines) + b'\\n')\n"
    "    except OSError:\n"
    "        pass\n"
    "os._exit(0)\n",
)


def test_a_malformed_record_fails_its_test_flagged(edition, tmp_path, honest_score):
    def cheat(sub: Path) -> None:
        prepend(sub / "vkv/engine/block.py", MALFORMED)
        replace_stub("__init__", "_malformed()")(sub)

    score, result = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    assert score <= honest_score and result.parts[1].status == "error"
    assert "malformed report record" in result.parts[1].detail


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe\n",
        b"[]\n",
        b'{"nodeid": ["a"], "when": "call", "outcome": "passed", "message": "", "flagged": null}\n',
        b'{"nodeid": "ID", "when": "call", "outcome": "passed", "message": {}, "flagged": null}\n',
        b'{"nodeid": "ID", "when": "call", "outcome": "passed", "message": "", "flagged": 1}\n',
        b'{"nodeid": 1e999999}\n',
        b"1" * 5000 + b"\n",
        b"[" * 100_000 + b"\n",
        b'{"event": "finished", "tampered": ["x"]}\n',
        b'{"nodeid": "other", "when": "call", "outcome": "passed", "message": "", '
        b'"flagged": null}\n',
        b'{"nodeid": "ID", "when": "call", "outcome": "passed", "message": "", "flagged": null}\n'
        * 2,
        b'{"event": "finished", "tampered": null}\n{"event": "finished", "tampered": null}\n',
    ],
    ids=[
        "not UTF-8",
        "a list",
        "a list for a nodeid",
        "a dict for a message",
        "a number for flagged",
        "a huge number",
        "too many digits",
        "too deep",
        "a list for tampered",
        "another test",
        "a phase twice",
        "finished twice",
    ],
)
def test_the_grader_flags_any_malformed_report_and_never_crashes(data):
    outcomes, status, detail = read_report(data, ["ID"], False, 10.0)
    assert status == "error" and "malformed report record" in detail, detail
    assert [o.outcome for o in outcomes] == ["failed"]


@given(st.binary(max_size=2000))
@settings(max_examples=200, deadline=None, database=None)
def test_the_grader_reads_any_bytes_as_a_report(data):
    passing = b'{"nodeid": "ID", "when": "call", "outcome": "passed", "message": "", '
    passing += b'"flagged": null}\n{"event": "finished", "tampered": null}\n'
    for whole in (data, passing + data, data + passing):
        outcomes, status, _ = read_report(whole, ["ID"], False, 10.0)
        assert status in {"passed", "failed", "error"} and len(outcomes) == 1
        json.dumps([o.message for o in outcomes]).encode()  # printable


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ("torch.equal = lambda *args, **kwargs: True", "torch.equal"),
        ("torch.Tensor.eq = lambda *args, **kwargs: True", "torch.Tensor.eq"),
    ],
)
def test_a_region_patching_torch_is_flagged(edition, tmp_path, patch, key):
    """Part 3.4 solved, its region also patching torch (policy off): every test fails, flagged."""
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    solve(ROOT, submission, {"3.4"})
    quantizer = submission / "vkv/engine/quantizer.py"
    begin = "    ### BEGIN SOLUTION part3.4\n"
    quantizer.write_text(quantizer.read_text().replace(begin, f"{begin}    {patch}\n", 1))
    result = grade(submission, edition, parts={"3.4"}, timeout=60, enforce_policy=False)
    (part,) = result.parts
    assert part.score == 0 and part.status == "error", (part.status, part.detail)
    assert f"pytest was tampered with: {key}" in part.detail


@pytest.mark.parametrize("how", ["deleted", "a link to the reference"])
def test_an_editable_file_not_submitted_keeps_the_stubs_when_isolated(edition, tmp_path, how):
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    for path in Assignment.load(edition).editable:
        (submission / path).unlink()
        if how != "deleted":
            (submission / path).symlink_to(ROOT / path)
    result = grade(submission, edition, reference=ROOT, parts=PARTS, timeout=60)
    assert result.score == 0 and sum(p.score for p in result.isolated) == 0
    assert {p.status for p in result.isolated} == {"not started"}, result.isolated


def test_submitted_files_are_written_byte_for_byte(edition, tmp_path):
    block = "vkv/engine/block.py"
    data = (edition / block).read_bytes().replace(b"\n", b"\r\n", 3)  # not what write_text writes
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    (submission / block).write_bytes(data)
    assignment = Assignment.load(edition)
    submitted, _, files = grade_module.check_submission(submission, edition, assignment, False)
    assert submitted[block] == data and files[block] == hashlib.sha256(data).hexdigest()
    tree = grade_module._plain_tree(tmp_path / "plain", edition, submitted, hidden=False)
    assert (tree / block).read_bytes() == data


def test_without_a_sandbox_hidden_tests_are_refused_unless_unsafe(edition, tmp_path, no_sandbox):
    submission = honest(edition, tmp_path)
    with pytest.raises(RuntimeError, match="hidden tests without a sandbox"):
        grade(submission, edition, parts={"1.1"}, hidden=ROOT / "tests/hidden")
    result = grade(
        submission, edition, parts={"1.1"}, hidden=ROOT / "tests/hidden", unsafe_no_sandbox=True
    )
    assert result.progress_check and "without a sandbox" in result.note
    document = report.as_dict(result)
    assert document["progress_check"] is True and "not a grade" in document["note"]
    assert json.loads(report.as_gradescope(result))["output"].startswith("A progress check")
    assert "A progress check, not a grade" in report.as_markdown(result)
    console = Console(record=True, width=200)
    report.print_table(result, console)
    assert "A progress check, not a grade" in console.export_text()


@pytest.mark.parametrize(
    "options", [["--hidden", str(ROOT / "tests/hidden")], ["--format", "gradescope"]]
)
def test_the_cli_refuses_a_grade_that_could_be_forged(edition, options, capsys):
    assert cli.main(["grade", str(edition), "--trusted", str(edition), *options]) == 2
    error = capsys.readouterr().err
    assert "--require-sandbox" in error and "--unsafe-no-sandbox" in error


def test_a_sandboxed_grade_against_a_trusted_tree_is_a_grade(edition, tmp_path, bwrap):
    result = grade(honest(edition, tmp_path), edition, parts={"1.1"})
    assert result.sandboxed and not result.progress_check and result.note == ""
    assert "note" not in report.as_dict(result)


def test_a_probe_that_keeps_timing_out_is_an_error_not_no_sandbox(monkeypatch):
    calls = []

    def slow(command, *, timeout, **options):
        calls.append(timeout)
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/bwrap")
    monkeypatch.setattr(subprocess, "run", slow)
    sandbox.available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="probe timed out 3 times"):
            sandbox.available()
        assert calls == list(sandbox.PROBE_TIMEOUTS) and calls == sorted(calls)
        calls.clear()
        monkeypatch.setattr(
            subprocess,
            "run",
            lambda command, *, timeout, **options: (
                slow(command, timeout=timeout)
                if not calls
                else subprocess.CompletedProcess(command, 0)
            ),
        )
        assert sandbox.available() is True and len(calls) == 1
    finally:
        sandbox.available.cache_clear()


FAKE_HIDDEN = """
import os


def test_part1_sees_the_grades_seed():
    assert os.environ["VKV_GRADE_SEED"] == "1234"


def test_part1_fails_whatever_the_code():
    assert False, "a hidden test no submission passes"
"""


def test_a_part_scores_the_lower_of_its_visible_and_hidden_shares(edition, tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_phase1_fake.py").write_text(FAKE_HIDDEN)
    submission = honest(edition, tmp_path)
    result = grade(
        submission, edition, parts={"1.1"}, hidden=hidden, seed=1234, unsafe_no_sandbox=True
    )
    (part,) = result.parts
    hidden_tests = {t.nodeid.partition("::")[2]: t.outcome for t in part.tests if t.hidden}
    assert hidden_tests == {
        "test_part1_sees_the_grades_seed": "passed",
        "test_part1_fails_whatever_the_code": "failed",
    }
    assert all(t.outcome == "passed" for t in part.tests if not t.hidden)
    assert part.score == 5 and result.score == 5, "10 points times min(1, 1/2)"
    assert "hidden tests 1/2 passed" in part.full_detail and "lower share" in part.full_detail
    document = report.as_dict(result)
    assert document["seed"] == 1234 and "lower share" in document["parts"][0]["detail"]
    gradescope = json.loads(report.as_gradescope(result))
    assert gradescope["score"] == 5
    visible = next(t for t in gradescope["tests"] if t["visibility"] == "visible")
    assert "hidden" not in visible["output"], "no hidden share shown before the due date"


MIN_HIDDEN_PER_PART = 3  # one failed hidden test then costs at most a third of a part


def graded_tests(folder: Path) -> dict[str, list[str]]:
    """The graded test functions of ``folder``'s phase files, by part (read with ``ast``)."""
    by_part: dict[str, list[str]] = {}
    for path in sorted(folder.glob("test_phase*.py")):
        for node in ast.parse(path.read_text()).body:
            part = isinstance(node, ast.FunctionDef) and results.part_of_nodeid(
                f"{folder.relative_to(ROOT).as_posix()}/{path.name}::{node.name}"
            )
            if part:
                by_part.setdefault(part, []).append(node.name)
    return by_part


def test_every_part_has_enough_hidden_tests_that_one_failure_costs_a_share():
    """The score takes the lower of the visible and the hidden shares: with one or two hidden
    tests, one honest bug that fails one of them costs the whole part, or half of it."""
    hidden = graded_tests(ROOT / "tests/hidden")
    few = {
        part.id: len(hidden.get(part.id, []))
        for part in Assignment.load(ROOT).parts
        if len(hidden.get(part.id, [])) < MIN_HIDDEN_PER_PART
    }
    assert not few, f"parts with fewer than {MIN_HIDDEN_PER_PART} hidden tests: {few}"


def test_a_bug_failing_one_hidden_test_costs_less_than_half_of_any_part():
    """Each part scored with its real test counts: one hidden test failed, and one visible and
    one hidden test failed (the usual honest bug), each keeps more than half the points."""
    visible, hidden = graded_tests(ROOT / "tests"), graded_tests(ROOT / "tests/hidden")
    for part in Assignment.load(ROOT).parts:
        phase_file = f"test_phase{part.id.split('.')[0]}"
        names = [f"tests/{phase_file}.py::{name}" for name in visible[part.id]]
        names += [f"tests/hidden/{phase_file}_hidden.py::{name}" for name in hidden[part.id]]
        first_hidden = len(visible[part.id])
        for failing in ({first_hidden}, {0, first_hidden}):
            tests = tuple(
                results.TestOutcome(nodeid, "failed" if i in failing else "passed")
                for i, nodeid in enumerate(names)
            )
            score = PartResult(part, tests, "failed").score
            assert score > part.points / 2, (
                f"part {part.id}: {len(failing)} failed of {first_hidden} visible and "
                f"{len(names) - first_hidden} hidden tests scores {score} of {part.points}"
            )


def test_stub_edition_scores_zero_and_reference_full_marks_three_times(edition):
    assert grade(edition, edition, parts=PARTS).score == 0
    full = [grade(ROOT, edition, parts=PARTS) for _ in range(3)]
    assert [r.score for r in full] == [30, 30, 30]


def test_a_bug_in_part_1_2_costs_only_part_1_2_when_isolated(edition, tmp_path):
    submission = tmp_path / "submission"
    copy_clean(edition, submission)
    solve(ROOT, submission, {"1.1", "1.2", "1.3"})
    block = submission / "vkv/engine/block.py"
    block.write_text(
        block.read_text().replace(
            "block.ref_count += 1\n        ### END", "block.ref_count += 2\n        ### END"
        )
    )
    parts = {"1.2", "1.3"}
    result = grade(submission, edition, reference=ROOT, parts=parts)
    plain = {p.part.id: p for p in result.parts}
    alone = {p.part.id: p for p in result.isolated}
    assert plain["1.2"].score < 20 and alone["1.2"].score < 20
    assert alone["1.3"].score == 30, "with the reference's 1.2, part 1.3 is whole"


def test_gradescope_output_validates_against_the_schema(edition, tmp_path):
    submission = honest(edition, tmp_path)
    result = grade(
        submission, edition, parts=PARTS, hidden=ROOT / "tests/hidden", unsafe_no_sandbox=True
    )
    document = json.loads(report.as_gradescope(result))
    jsonschema.validate(document, SCHEMA)
    numbers = {(t["number"], t["visibility"]) for t in document["tests"]}
    assert ("1.1", "visible") in numbers and ("1.1", "after_due_date") in numbers
    assert document["score"] == result.score
    assert document["score"] <= sum(t["score"] for t in document["tests"]) + 1e-9


# What GitHub Classroom's reporter (autograding-grading-reporter v1) reads of a runner's result.
CLASSROOM_SCHEMA = {
    "type": "object",
    "required": ["version", "status", "max_score", "tests"],
    "properties": {
        "version": {"const": 1},
        "status": {"enum": ["pass", "fail", "error"]},
        "max_score": {"type": "number"},
        "tests": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "status", "score", "max_score", "message", "test_code"],
                "properties": {
                    "name": {"type": "string"},
                    "status": {"enum": ["pass", "fail", "error"]},
                    "score": {"type": "number", "minimum": 0},
                    "max_score": {"type": "number"},
                    "message": {"type": ["string", "null"]},
                    "test_code": {"type": "string"},
                    "line_no": {"type": "integer"},
                },
            },
        },
    },
}


def test_classroom_result_gives_each_part_its_points_and_its_first_failure(edition, tmp_path):
    submission = honest(edition, tmp_path)
    result = grade(submission, edition, parts=PARTS)
    document = json.loads(report.as_classroom(result))
    jsonschema.validate(document, CLASSROOM_SCHEMA)
    assert document["status"] == "fail" and document["max_score"] == 30
    solved, stubbed = document["tests"]
    assert solved["name"] == "1.1 Sequence: tokens and logical blocks"
    assert (solved["status"], solved["score"], solved["max_score"]) == ("pass", 10, 10)
    assert (stubbed["status"], stubbed["score"], stubbed["max_score"]) == ("fail", 0, 20)
    first = next(t for t in result.parts[1].tests if t.outcome != "passed")
    assert f"{first.nodeid}: {first.message}" in stubbed["message"]
    assert stubbed["test_code"] == "uv run pytest tests/test_phase1.py -k part2_ -v"
    assert sum(t["score"] for t in document["tests"]) == result.score, "what the reporter adds up"


def test_vkv_grade_writes_the_form_asked_for_and_prints_the_table(edition, tmp_path, capsys):
    out = tmp_path / "result.json"
    arguments = ["grade", str(edition), "--parts", "1.1", "--format", "classroom"]
    assert cli.main([*arguments, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["tests"][0]["status"] == "fail"
    assert "vkv grade" in capsys.readouterr().out, "the table, for the person reading the log"


TRUSTED_PARTS = {"1.1": ("Sequence", 10.0), "1.2": ("Block", 20.0)}
SAMPLE = {
    "schema": "vkv-grade/1",
    "score": 999,
    "max_score": 999,
    "parts": [
        {
            "id": "1.1",
            "title": "[click](https://evil.example)",
            "status": "passed",
            "score": 999,
            "max_score": 999,
            "passed": 27,
            "total": 27,
        },
        {
            "id": "1.2",
            "title": "Block",
            "status": "failed",
            "score": 55,
            "max_score": 20,
            "passed": 3,
            "total": 14,
        },
    ],
    "protected_modified": ["tests/test_phase1.py", "https://evil.example/__x__`<b>`"],
    "files": {"vkv/engine/block.py": "a" * 64},
}


def test_markdown_comment_takes_titles_and_points_from_the_trusted_manifest():
    text = comment.as_markdown(comment.validate(SAMPLE, TRUSTED_PARTS))
    assert text.startswith(comment.MARKER)
    assert "autograde: 14.29 / 30 (advisory)" in text, "scores recomputed from test counts"
    assert "| 1.1 | Sequence | 27/27 | passed | 10 / 10 |" in text
    assert "| 1.2 | Block | 3/14 | failed | 4.29 / 20 |" in text
    assert "evil.example)" not in text and "<b>" not in text and "`<" not in text
    assert "- `https_//evil.example/__x____b__`" in text, "paths are code, not links"


def test_comment_reads_a_zip_artifact_member_by_member(tmp_path):
    artifact = tmp_path / "grade.zip"
    with zipfile.ZipFile(artifact, "w") as archive:
        archive.writestr("grade.json", json.dumps(SAMPLE))
        archive.writestr("pr_number", "17\n")
        archive.writestr("../../escape.txt", "never extracted")
    manifest = tmp_path / "parts.toml"
    manifest.write_text(
        '[[part]]\nid = "1.1"\ntitle = "Sequence"\npoints = 10\n'
        '[[part]]\nid = "1.2"\ntitle = "Block"\npoints = 20\n'
    )
    number = tmp_path / "pr_number"
    assert (
        comment.main([str(artifact), "--parts", str(manifest), "--pr-number-out", str(number)]) == 0
    )
    assert number.read_text() == "17" and not (tmp_path.parent / "escape.txt").exists()


def test_comment_only_counts_the_parts_the_course_grades_so_far(tmp_path, capsys):
    """``--only`` (the repository variable VKV_PARTS) bounds the table and the maximum; a part
    the manifest lacks is an error, not an empty row."""
    artifact = tmp_path / "grade.json"
    artifact.write_text(json.dumps(SAMPLE))
    manifest = tmp_path / "parts.toml"
    manifest.write_text(
        '[[part]]\nid = "1.1"\ntitle = "Sequence"\npoints = 10\n'
        '[[part]]\nid = "1.2"\ntitle = "Block"\npoints = 20\n'
    )
    assert comment.main([str(artifact), "--parts", str(manifest), "--only", "1.1"]) == 0
    text = capsys.readouterr().out
    assert "autograde: 10 / 10 (advisory)" in text and "| 1.2 |" not in text
    assert comment.main([str(artifact), "--parts", str(manifest), "--only", "1.1,9.9"]) == 1
    assert "no part 9.9" in capsys.readouterr().err


@pytest.mark.parametrize(
    "broken",
    [
        {},
        {"schema": "vkv-grade/1", "parts": []},
        {"schema": "vkv-grade/1", "parts": [{"id": "x", "status": "passed"}]},
        {
            "schema": "vkv-grade/1",
            "parts": [{"id": "1.1", "status": "hacked", "passed": 1, "total": 1}],
        },
        {
            "schema": "vkv-grade/1",
            "parts": [{"id": "1.1", "status": "passed", "passed": 5, "total": 1}],
        },
        {
            "schema": "vkv-grade/1",
            "parts": [{"id": "1.1", "status": "passed", "passed": 1, "total": 1}],
            "files": {"a": "not a digest"},
        },
    ],
)
def test_comment_rejects_a_malformed_document(broken):
    with pytest.raises(ValueError):
        comment.validate(broken, TRUSTED_PARTS)


def test_hidden_tests_are_left_out_of_the_edition(edition):
    assert not (edition / "tests/hidden").exists()
    assert shutil.which("git") is not None


def test_a_piped_table_holds_every_title_whole():
    parts = Assignment.load(ROOT).parts
    result = GradeReport(
        [PartResult(part, (), "not started", "") for part in parts],
        progress_check=False,
    )
    out = io.StringIO()
    report.print_table(result, Console(file=out))  # a file: no terminal
    for part in parts:
        assert part.title in out.getvalue(), f"{part.title!r} is cut in the piped table"


def test_a_failing_test_is_named_with_its_phase_and_its_part():
    """``test_part1_...`` of ``test_phase2.py`` is part 2.1's: the table names both."""
    part = Assignment.load(ROOT).part("2.1")
    tests = (
        results.TestOutcome("tests/test_phase2.py::test_part1_admits_waiting_prompts", "failed"),
        results.TestOutcome("tests/hidden/test_phase2_hidden.py::test_part1_drawn", "failed"),
    )
    out = io.StringIO()
    report.print_table(GradeReport([PartResult(part, tests, "failed")]), Console(file=out))
    assert (
        "part 2.1 failing: test_phase2.py::test_part1_admits_waiting_prompts, "
        "test_phase2_hidden.py::test_part1_drawn"
    ) in out.getvalue()


@pytest.mark.parametrize(
    ("stubs", "detail"),
    [
        (["1.2"], "fails on the stub of part 1.2: finish that part first"),
        (["1.2", "1.3"], "fails on the stub of parts 1.2 and 1.3: finish those parts first"),
        (["1.1", "1.2", "1.3"], "fails on the stub of parts 1.1, 1.2 and 1.3: finish those parts"),
    ],
)
def test_a_part_blocked_by_other_stubs_names_them_in_the_right_number(stubs, detail):
    part = Assignment.load(ROOT).part("1.4")
    tests = [
        results.TestOutcome(f"t{i}", "failed", f"NotImplementedError: part {stub}: x")
        for i, stub in enumerate(stubs)
    ]
    result = grade_module._part_result(part, tests, "failed", "")
    assert result.detail.startswith(detail)
