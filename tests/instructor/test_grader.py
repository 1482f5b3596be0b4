"""``vkv grade`` against submissions that try to cheat, and its output formats.

Each cheat starts from an honest submission (Part 1.1 solved, Part 1.2 not) and must score no
more than it. Only parts 1.1 and 1.2 are graded, to keep each grade to a few seconds. Code
outside a solution region is refused by the static policy before it runs; such cheats are
graded a second time with ``enforce_policy=False`` (and, where a test says so, without the
sandbox), so that the guard behind the policy is tested on its own. ``test_attacks.py`` has
the attacks of the grader's adversarial review.
"""

import json
import shutil
import zipfile
from pathlib import Path

import jsonschema
import pytest

from vkv.assignment import comment, report, sandbox
from vkv.assignment.grade import copy_clean, grade
from vkv.assignment.release import release, solve

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"1.1", "1.2"}
SCHEMA = json.loads((Path(__file__).parent / "gradescope_schema.json").read_text())


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edition") / "edition"
    release(ROOT, out, commit=False)
    return out


@pytest.fixture(scope="module")
def honest_score(edition, tmp_path_factory) -> float:
    submission = honest(edition, tmp_path_factory.mktemp("honest"))
    return grade(submission, edition, parts=PARTS).score


def honest(edition: Path, where: Path) -> Path:
    submission = where / "submission"
    copy_clean(edition, submission)
    solve(ROOT, submission, {"1.1"})
    return submission


def cheat_score(edition: Path, where: Path, cheat, **options) -> tuple[float, object]:
    submission = honest(edition, where)
    cheat(submission)
    result = grade(submission, edition, parts=PARTS, timeout=15, **options)
    return result.score, result


def guarded_score(edition: Path, where: Path, cheat) -> tuple[float, object]:
    """The cheat graded twice: refused by the policy, then caught by what lies behind it."""
    _, result = cheat_score(edition, where / "policy", cheat)
    assert result.parts[1].status == "not graded", result.parts[1]
    assert "code outside the solution regions changed" in result.parts[1].detail
    return cheat_score(edition, where / "guard", cheat, enforce_policy=False)


@pytest.fixture
def no_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox, "available", lambda: False)


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
    score, result = cheat_score(edition, tmp_path, cheat)
    assert score <= honest_score
    assert result.parts[1].status == "timeout"


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
    with pytest.raises(RuntimeError, match="trusted tree"):
        grade(submission, trusted, parts=PARTS, timeout=15, enforce_policy=False)


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
    "            record = {'nodeid': a, 'when': 'call', 'outcome': 'passed', 'message': ''}\n"
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
    reason="residual risk: code that runs in the test process can forge what that process "
    "writes; the static policy is what keeps such code from running",
)
def test_forging_the_report_from_inside_the_test_process(edition, tmp_path, honest_score):
    cheat = lambda s: prepend(s / "vkv/engine/block.py", FORGE)  # noqa: E731
    score, _ = cheat_score(edition, tmp_path, cheat, enforce_policy=False)
    assert score <= honest_score


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
    result = grade(submission, edition, parts=PARTS, hidden=ROOT / "tests/hidden")
    document = json.loads(report.as_gradescope(result))
    jsonschema.validate(document, SCHEMA)
    numbers = {(t["number"], t["visibility"]) for t in document["tests"]}
    assert ("1.1", "visible") in numbers and ("1.1", "after_due_date") in numbers
    assert document["score"] == pytest.approx(sum(t["score"] for t in document["tests"]))


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
