"""Run graded tests of a tree in a child process and read back one result per test."""

import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from vkv.assignment.parts import part_of_test


class TestRunError(RuntimeError):
    """pytest crashed or timed out before writing its report."""


@dataclass(slots=True, frozen=True)
class TestResult:
    """One test's outcome: ``passed``, ``failed``, ``error`` or ``skipped``."""

    file: str
    name: str
    outcome: str
    message: str

    @property
    def part(self) -> str | None:
        return part_of_test(Path(self.file).name, self.name)

    @property
    def nodeid(self) -> str:
        return f"{self.file}::{self.name}"


def run_tests(
    tree: Path, files: list[str], timeout: float = 600.0, options: tuple[str, ...] = ()
) -> list[TestResult]:
    """Run pytest on ``files`` of ``tree``, importing ``vkv`` from ``tree``; one result per test.

    ``files`` may also be node ids; ``options`` go to pytest as they are (e.g. ``-x``).

    Raises ``TestRunError`` when pytest produced no report (it crashed or ran past ``timeout``
    seconds; the whole process group is killed then).
    """
    with tempfile.TemporaryDirectory(prefix="vkv-junit-") as scratch:
        report = Path(scratch) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit2",
            *options,
            *files,
        ]
        env = dict(
            os.environ,
            PYTHONPATH=str(tree),
            PYTHONDONTWRITEBYTECODE="1",
            VKV_HYPOTHESIS_SHRINK="0",  # pass or fail is all a grade needs
        )
        process = subprocess.Popen(
            command,
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise TestRunError(f"pytest in {tree} ran past {timeout:.0f} s") from exc
        if not report.is_file():
            raise TestRunError(f"pytest in {tree} wrote no report:\n{output[-2000:]}")
        return _parse_junit(report)


def _parse_junit(report: Path) -> list[TestResult]:
    results = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "")
        file = module.replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        results.append(TestResult(file, case.get("name", ""), outcome, message.strip()))
    return results
