"""The scheduler A/B script against ``--base HEAD``, one sequence, one repeat: a row for each
configuration, with this tree's steps and preemptions (the script prints both trees' so that a
ratio is read as like against like; HEAD's may differ while a scheduler change is uncommitted)
and a time on each side."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab_scheduler
from bench_scheduler import run_once

IN_GIT = (
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ab_scheduler.ROOT, capture_output=True)
).returncode == 0


@pytest.mark.skipif(not IN_GIT, reason="ab_scheduler checks --base out of git: not a git clone")
def test_one_sequence_against_head_gives_each_configuration_its_row(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # rich's table on one line a row
    argv = ["ab_scheduler.py", "--base", "HEAD", "--seqs", "1", "--repeat", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    ab_scheduler.main()
    printed = capsys.readouterr().out
    rows = {}
    for line in printed.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells and cells[0] in {name for name, _, _ in ab_scheduler.CONFIGS}:
            rows[cells[0]] = cells
    assert list(rows) == [name for name, _, _ in ab_scheduler.CONFIGS], printed
    for name, block_size, pool in ab_scheduler.CONFIGS:
        _, steps, preemptions, base_us, now_us, ratio = rows[name]
        here = run_once(block_size, pool, 1)
        base_steps, now_steps = steps.split(" / ")
        assert now_steps == str(here["steps"]) and int(base_steps) > 0, (name, steps)
        base_preemptions, now_preemptions = preemptions.split(" / ")
        assert now_preemptions == str(here["preemptions"]) and int(base_preemptions) >= 0, name
        assert float(base_us) > 0 and float(now_us) > 0 and float(ratio.removesuffix("x")) > 0
    worktrees = subprocess.run(
        ["git", "worktree", "list"], cwd=ab_scheduler.ROOT, capture_output=True, text=True
    ).stdout
    assert "vkv-ab-" not in worktrees, f"the base's worktree is removed: {worktrees}"
