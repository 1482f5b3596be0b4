"""A student's first run, as the student README tells them to start: short and about their code.

``transcripts/first-failing-run.txt`` is that run on a fresh student edition (regenerate it with
``VKV_UPDATE_TRANSCRIPTS=1``). Every failure names part 1.1; no report holds an error raised in
a ``repr()`` of a half-built object, and nothing advises ``git apply`` of a Hypothesis patch to
a test file the student may not edit.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

TRANSCRIPT = Path(__file__).parent / "transcripts" / "first-failing-run.txt"
COMMAND = ["tests/test_phase1.py", "-k", "part1", "-v"]  # the student README's first command


def first_run(edition: Path) -> str:
    """The run's output, with the edition's path, the interpreter line and timings made fixed."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *COMMAND],
        cwd=edition,
        env={**os.environ, "PYTHONPATH": str(edition)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    text = run.stdout.replace(str(edition), "<edition>").replace(sys.executable, "<python>")
    text = re.sub(r"^platform .*$", "platform <...>", text, flags=re.M)
    return re.sub(r" in \d+\.\d+s( \(\d+:\d+:\d+\))?", " in <time>", text)


def failed(transcript: str) -> list[str]:
    return [line.split(" - ")[0] for line in transcript.splitlines() if line.startswith("FAILED ")]


def test_the_first_failing_run_is_about_part_1_1_and_nothing_else(edition):
    transcript = first_run(edition)
    if os.environ.get("VKV_UPDATE_TRANSCRIPTS") == "1":
        TRANSCRIPT.write_text(transcript)
    checked_in = TRANSCRIPT.read_text()
    for text in (transcript, checked_in):
        assert "raised in repr()" not in text
        assert "git apply" not in text and ".hypothesis/patches" not in text
        stubs = set(re.findall(r"NotImplementedError: part (\d+\.\d+):", text))
        assert stubs == {"1.1"}, f"the first run's failures name parts {sorted(stubs)}"
    assert failed(transcript) == failed(checked_in), (
        "the checked-in transcript is stale: VKV_UPDATE_TRANSCRIPTS=1 uv run pytest "
        "tests/instructor/test_first_run.py"
    )
