"""Replay every hidden test of some phases over many seeds, on the reference, in one process.

A hidden test draws its inputs from the grade's seed (``tests/hidden/test_seed.py``), and
``vkv assignment check`` runs the hidden suite about forty times, each with a fresh seed: a draw
that fails correct code one time in a thousand fails CI now and then. This script finds such
draws before CI does. It calls each ``@seeded`` test's undecorated function with the stream of
seed 0, 1, 2, ... (``rng_for(name, seed)``), a fresh ``tmp_path`` and ``monkeypatch`` each time,
until ``--seeds`` draws or ``--seconds`` per test, and prints each test that failed with the seeds
that make it fail (replay one with ``VKV_GRADE_SEED=<seed> uv run pytest tests/hidden -k name``).

    uv run python scripts/seed_sweep.py [--phases 1,2,4,5] [--seeds 300] [--seconds 5]

Exit status 1 if any draw failed. Phase 3's tests run the Triton interpreter (seconds a call):
give them a larger ``--seconds``.
"""

import argparse
import importlib
import inspect
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = {"tmp_path", "monkeypatch"}


def fixtures_of(test) -> list[str]:
    """The fixtures a ``@seeded`` test takes after its ``rng``."""
    return list(inspect.signature(test.__wrapped__).parameters)[1:]


def sweep(test, seeds: int, seconds: float) -> tuple[int, list[tuple[int, str]]]:
    """Run ``test`` (a ``@seeded`` wrapper) on seeds 0, 1, ... within the limits; return how
    many ran and the failing ones with their error."""
    from test_seed import rng_for

    ran, failures, started = 0, [], time.monotonic()
    while ran < seeds and time.monotonic() - started < seconds:
        rng = rng_for(test.__name__, ran)
        with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
            given = {"tmp_path": Path(folder), "monkeypatch": patch}
            try:
                test.__wrapped__(rng, **{name: given[name] for name in fixtures_of(test)})
            except pytest.skip.Exception:
                return ran, failures
            except Exception as failure:  # a graded test's failure, whatever its type
                failures.append((ran, f"{type(failure).__name__}: {failure}".splitlines()[0]))
        ran += 1
    return ran, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="1,2,4,5", help="comma-separated phase numbers")
    parser.add_argument("--seeds", type=int, default=300, help="draws per test, at most")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per test, at most")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "hidden"), str(ROOT / "tests"), str(ROOT)]
    failed = False
    for phase in args.phases.split(","):
        module = importlib.import_module(f"tests.hidden.test_phase{phase}_hidden")
        tests = [t for name, t in vars(module).items() if name.startswith("test_")]
        for test in tests:
            if not hasattr(test, "__wrapped__"):
                continue
            others = set(fixtures_of(test)) - FIXTURES
            if others:
                print(f"skipped {test.__name__}: it takes {sorted(others)}")
                continue
            ran, failures = sweep(test, args.seeds, args.seconds)
            seeds = ", ".join(str(seed) for seed, _ in failures[:5])
            print(f"{test.__name__}: {ran} seeds, {len(failures)} failed {seeds}", flush=True)
            for _, error in failures[:1]:
                print(f"    {error[:300]}")
            failed |= bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
