"""Fixtures shared by the instructor suite: a fresh student edition and the sandbox's state."""

import os
from pathlib import Path

import pytest

from vkv.assignment import sandbox
from vkv.assignment.release import release

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def edition(tmp_path_factory) -> Path:
    """The student edition of this repository, released once per test process (tests copy it
    before they change anything in it)."""
    out = tmp_path_factory.mktemp("edition") / "edition"
    release(ROOT, out, commit=False)
    return out


@pytest.fixture
def bwrap():
    """Skip where bubblewrap cannot run; fail instead when ``VKV_REQUIRE_SANDBOX=1``."""
    if not sandbox.available():
        if os.environ.get("VKV_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"VKV_REQUIRE_SANDBOX=1 but {sandbox.why_unavailable()}")
        pytest.skip(sandbox.why_unavailable())


@pytest.fixture
def no_sandbox(monkeypatch):
    """Grade as on a machine without bubblewrap."""
    monkeypatch.setattr(sandbox, "available", lambda: False)
