"""``vkv assignment gradescope``: the package, run as Gradescope runs it, in a simulated layout.

The zip is built through the CLI (grading parts 1.1 and 1.2 only, to keep the run short),
unpacked into ``<tmp>/autograder/source`` with each file's mode, and ``run_autograder`` is
copied to ``<tmp>/autograder/run_autograder``, as Gradescope's image build does. A bubblewrap
mount namespace binds ``<tmp>/autograder`` at ``/autograder`` (and the rest of this machine at
its own paths), so the package's absolute paths are Gradescope's; ``run_autograder`` then runs
there with ``/autograder`` as its working directory. ``setup.sh`` is not run (it installs from
the network): the ``uv`` of this environment is put on ``PATH`` instead, and its last step,
``uv sync --frozen`` in ``source/edition``, is done by the fixture, offline from uv's cache and
outside the namespace (whose bind mounts are separate mounts, across which uv cannot hardlink
from its cache: it would copy 5.5 GB). Each submission is placed in
``/autograder/submission``; the results are read from ``/autograder/results/results.json`` and
checked against Gradescope's documented fields (``gradescope_schema.json``).

Three submissions: the stub edition (0), the edition with the reference's parts 1.1 and 1.2
(full marks, equal to ``grade``'s total on the same trees), and an attack on part 1.1 (its
region writes a forged results.json; it also edits the visible tests and adds a conftest that
forges the results), which scores 0 for part 1.1 while part 1.2 keeps its points. The stub
edition is graded once more where the grader's bwrap cannot run: the results then begin by
saying that they are a progress check. Needs
bubblewrap (skipped without it, unless ``VKV_REQUIRE_SANDBOX=1``) and root, as on Gradescope.
About a minute on 2 busy cores.
"""

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import jsonschema
import pytest

from vkv.assignment.grade import grade
from vkv.assignment.gradescope import package
from vkv.assignment.release import solve
from vkv.assignment.trees import copy_clean
from vkv.cli import main

ROOT = Path(__file__).resolve().parents[2]
PARTS = "1.1,1.2"
POINTS = 30  # parts 1.1 and 1.2
SCHEMA = json.loads((Path(__file__).parent / "gradescope_schema.json").read_text())
SEQUENCE = "vkv/engine/sequence.py"
FORGED = '{"score": 999, "tests": []}'
FORGE_IN_THE_REGION = f"""\
        ### BEGIN SOLUTION part1.1
        open("/autograder/results/results.json", "w").write('{FORGED}')
"""
FORGE_IN_A_CONFTEST = f"""\
open("/autograder/results/results.json", "w").write('{FORGED}')
import os
os._exit(0)
"""


def unpack(archive: Path, target: Path) -> None:
    """Extract ``archive`` into ``target`` as ``unzip`` does, keeping each file's mode (Python's
    ``extractall`` drops it)."""
    with zipfile.ZipFile(archive) as opened:
        for info in opened.infolist():
            path = Path(opened.extract(info, target))
            path.chmod((info.external_attr >> 16) & 0o777)


@pytest.fixture(scope="module")
def autograder(tmp_path_factory) -> Path:
    """``<tmp>/autograder`` as Gradescope lays it out once the package is installed."""
    if os.geteuid() != 0:
        pytest.skip("Gradescope runs the autograder as root; this simulation needs root too")
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("no uv on PATH to stand in for the one setup.sh installs")
    work = tmp_path_factory.mktemp("gradescope")
    archive = work / "autograder.zip"
    assert main(["assignment", "gradescope", str(archive), "--parts", PARTS]) == 0
    layout = work / "autograder"
    unpack(archive, layout / "source")
    shutil.copy2(layout / "source/run_autograder", layout / "run_autograder")
    environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    sync = [uv, "sync", "--frozen", "--offline", "--quiet"]
    subprocess.run(sync, cwd=layout / "source/edition", env=environment, check=True)
    return layout


def run_autograder(layout: Path, submission: Path, sandbox_works: bool = True) -> dict:
    """Place ``submission`` in ``/autograder/submission``, run ``/autograder/run_autograder``
    there, and return the results it wrote. With ``sandbox_works=False`` the namespace mounts a
    fresh proc, which bwrap covers in part, and the kernel then refuses the grader's own bwrap
    its proc mount: the grader's probe fails, as in a container that forbids user namespaces."""
    for folder in ("submission", "results"):
        shutil.rmtree(layout / folder, ignore_errors=True)
    copy_clean(submission, layout / "submission")
    (layout / "results").mkdir()
    uv = Path(os.environ.get("UV") or shutil.which("uv") or "uv")
    # /proc is bound, not mounted anew: the grader's own bwrap inside mounts a proc of its
    # own, which the kernel allows only where the proc above it is fully visible
    command = ["bwrap", "--die-with-parent", "--dev", "/dev"]
    command += ["--bind", "/proc", "/proc"] if sandbox_works else ["--proc", "/proc"]
    for entry in sorted(Path("/").iterdir()):
        if entry.name in ("proc", "dev", "autograder"):
            continue
        if entry.is_symlink():
            command += ["--symlink", os.readlink(entry), str(entry)]
        else:
            command += ["--bind", str(entry), str(entry)]
    command += ["--bind", str(layout), "/autograder", "--chdir", "/autograder"]
    command.append("/autograder/run_autograder")
    environment = {
        "PATH": f"{uv.parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"run_autograder failed:\n{done.stdout[-3000:]}{done.stderr}"
    results = json.loads((layout / "results/results.json").read_text())
    jsonschema.validate(results, SCHEMA)
    return results


def check_fields(results: dict, sandboxed: bool = True) -> None:
    """What the package promises beyond the schema: every field the README names, present with
    its type, a total equal to the tests' sum, and the output saying how the grade ran."""
    assert isinstance(results["score"], int | float)
    assert isinstance(results["execution_time"], int | float) and results["execution_time"] >= 0
    assert isinstance(results["output"], str)
    assert results["visibility"] == "visible" and results["stdout_visibility"] == "hidden"
    assert results["tests"], "one entry per part, and one for its hidden tests"
    for test in results["tests"]:
        assert set(test) >= {"name", "number", "score", "max_score", "status", "output"}, test
        assert 0 <= test["score"] <= test["max_score"]
        assert test["status"] == ("passed" if test["score"] == test["max_score"] else "failed")
    assert sum(t["max_score"] for t in results["tests"]) == pytest.approx(POINTS, abs=0.02)
    assert sum(t["score"] for t in results["tests"]) == pytest.approx(results["score"], abs=0.02)
    if sandboxed:
        assert "graded in a bubblewrap sandbox" in results["output"], results["output"]
    else:
        first = results["output"].splitlines()[0]
        assert first.startswith("A progress check, not a grade") and "without a sandbox" in first


def test_the_zip_has_setup_and_run_autograder_at_its_root_and_refuses_an_existing_file(tmp_path):
    archive = tmp_path / "autograder.zip"
    names = package(ROOT, archive)
    assert names[:2] == ["setup.sh", "run_autograder"]
    with zipfile.ZipFile(archive) as opened:
        modes = {info.filename: info.external_attr >> 16 for info in opened.infolist()}
        run = opened.read("run_autograder").decode()
        setup = opened.read("setup.sh").decode()
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111, "executable scripts"
    assert {"edition/uv.lock", "edition/assignment/parts.toml"} <= modes.keys()
    assert "hidden/test_phase1_hidden.py" in modes, "the hidden tests travel in the package"
    assert not any(n.startswith("edition/tests/hidden") for n in modes), "apart from the edition"
    assert "--parts" not in run, "without --parts the package grades every part"
    assert "apt-get install" in setup and "bubblewrap" in setup and "uv sync --frozen" in setup
    with pytest.raises(FileExistsError):
        package(ROOT, archive)


def test_the_command_refuses_an_unknown_part(tmp_path, capsys):
    archive = tmp_path / "autograder.zip"
    assert main(["assignment", "gradescope", str(archive), "--parts", "9.9"]) == 2
    assert "9.9" in capsys.readouterr().err and not archive.exists()


def test_the_stub_edition_scores_zero(autograder, edition, bwrap):
    results = run_autograder(autograder, edition)
    check_fields(results)
    assert results["score"] == 0 and all(t["score"] == 0 for t in results["tests"])


def test_without_a_working_sandbox_the_results_say_they_are_a_progress_check(
    autograder, edition, bwrap
):
    results = run_autograder(autograder, edition, sandbox_works=False)
    check_fields(results, sandboxed=False)
    assert results["score"] == 0


def test_the_reference_scores_full_marks_as_vkv_grade_does(autograder, edition, tmp_path, bwrap):
    solved = tmp_path / "solved"
    copy_clean(edition, solved)
    solve(ROOT, solved, set(PARTS.split(",")))
    results = run_autograder(autograder, solved)
    check_fields(results)
    direct = grade(
        solved,
        autograder / "source/edition",
        hidden=autograder / "source/hidden",
        parts=set(PARTS.split(",")),
        require_sandbox=True,
    )
    assert results["score"] == direct.score == direct.max_score == POINTS, results["tests"]


def test_an_attack_on_part_1_1_scores_0_there_and_forges_nothing(
    autograder, edition, tmp_path, bwrap
):
    attack = tmp_path / "attack"
    copy_clean(edition, attack)
    solve(ROOT, attack, set(PARTS.split(",")))
    sequence = attack / SEQUENCE
    text = sequence.read_text()
    assert text.count("### BEGIN SOLUTION part1.1\n") > 1
    sequence.write_text(
        text.replace("        ### BEGIN SOLUTION part1.1\n", FORGE_IN_THE_REGION, 1)
    )
    tests = attack / "tests/test_phase1.py"
    tests.write_text("def test_part1_everything_passes():\n    pass\n")
    (attack / "conftest.py").write_text(FORGE_IN_A_CONFTEST)
    results = run_autograder(autograder, attack)
    check_fields(results)
    scores = {t["name"]: t["score"] for t in results["tests"]}
    assert all(s == 0 for name, s in scores.items() if name.startswith("1.1 ")), scores
    assert all(s > 0 for name, s in scores.items() if name.startswith("1.2 ")), scores
    assert results["score"] == 20, "part 1.2's points, no more"
    for said in ("not graded:", "protected file modified: tests/test_phase1.py", "conftest.py"):
        assert said in results["output"], results["output"]
