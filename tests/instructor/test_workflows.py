"""The GitHub workflows: actionlint- and zizmor-clean, actions pinned by commit, least privilege."""

import re
import subprocess
from pathlib import Path

import pytest

from vkv.assignment.release import release

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github/workflows").glob("*.yml")) + sorted(
    (ROOT / "assignment/workflows").glob("*.yml")
)
USES = re.compile(r"^\s*(?:-\s*)?uses:\s*(\S+)", re.MULTILINE)


def test_actionlint_passes_on_every_workflow():
    done = subprocess.run(
        ["actionlint", *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_zizmor_finds_nothing_in_any_workflow():
    """zizmor's security audit at its default persona, offline (no GitHub API calls), over this
    repository's CI and the workflows the release copies into the student edition. A finding is
    fixed, or answered in the workflow by a ``# zizmor: ignore[rule]`` comment with the reason."""
    done = subprocess.run(
        ["zizmor", "--offline", *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned_by_commit_and_permissions_are_explicit(workflow):
    text = workflow.read_text()
    for action in USES.findall(text):
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", action), f"{action} is not pinned"
    assert "\npermissions:" in text, "every workflow states its token's permissions"


def test_the_privileged_workflow_never_touches_pull_request_code():
    text = (ROOT / "assignment/workflows/autograde-comment.yml").read_text()
    assert "workflow_run:" in text and "pull-requests: write" in text
    assert "ref:" not in text and "repository:" not in text, "one checkout: the default branch"
    assert text.count("head_sha }}") == 1 and "HEAD_SHA: ${{ github.event.workflow_run" in text, (
        "the graded head's sha is only compared with the pull request's, never checked out"
    )
    assert "uv run" not in text and "pip install" not in text, "nothing installed or run from it"


def test_the_grading_workflow_is_unprivileged_and_uses_only_base_code():
    text = (ROOT / "assignment/workflows/autograde.yml").read_text()
    assert "pull_request:" in text and "pull_request_target" not in text
    assert "contents: read" in text and ": write" not in text
    assert "ref: ${{ github.event.pull_request.base.sha }}" in text
    assert "--trusted ." in text


def test_the_grading_workflow_gets_the_pull_request_without_persisted_credentials():
    """A private repository (every GitHub Classroom one) refuses an anonymous fetch: the head
    comes through a checkout with the job's token, which is kept nowhere, never through a
    `git fetch` in a checkout whose credentials were not persisted."""
    text = (ROOT / "assignment/workflows/autograde.yml").read_text()
    checkouts = re.findall(r"uses: actions/checkout@\S+.*\n((?:\s+\w[\w-]*:.*\n)+)", text)
    with_blocks = [block for block in checkouts if "ref:" in block]
    assert any("head.sha }}" in block for block in with_blocks), "the head is checked out"
    assert all("persist-credentials: false" in block for block in checkouts)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "fetch" not in code, "no fetch that would need credentials"


@pytest.mark.parametrize("name", ["autograde.yml", "classroom.yml"])
def test_the_grading_workflows_require_the_sandbox(name):
    text = (ROOT / "assignment/workflows" / name).read_text()
    assert "assignment/prepare-sandbox.sh" in text and "--require-sandbox" in text
    script = (ROOT / "assignment/prepare-sandbox.sh").read_text()
    assert "apt-get install -y -qq bubblewrap" in script
    assert "kernel.apparmor_restrict_unprivileged_userns=0" in script


def test_the_classroom_workflow_grades_against_the_edition_without_persisted_credentials():
    """Classroom's reporter reads the workflow named "Autograding Tests"; the trusted tree is
    the repository's first commit (the edition as handed out), kept as files."""
    text = (ROOT / "assignment/workflows/classroom.yml").read_text()
    assert text.count("\nname: Autograding Tests\n") == 1 and "run-autograding-tests:" in text
    assert "push:" in text and "contents: read" in text and ": write" not in text
    assert "persist-credentials: false" in text and "fetch-depth: 0" in text
    assert "rev-list --max-parents=0 HEAD" in text and "--trusted ." in text
    assert "VKV_RESULTS: ${{ steps.vkv.outputs.result }}" in text and "runners: vkv" in text


def test_only_an_edition_released_for_classroom_has_its_workflow(tmp_path):
    release(ROOT, tmp_path / "plain", commit=False)
    release(ROOT, tmp_path / "classroom", commit=False, classroom=True)
    plain = sorted(p.name for p in (tmp_path / "plain/.github/workflows").iterdir())
    assert plain == ["autograde-comment.yml", "autograde.yml"]
    assert (tmp_path / "classroom/.github/workflows/classroom.yml").is_file()
    assert (tmp_path / "classroom/assignment/prepare-sandbox.sh").is_file()
