"""Has a change made the scheduler's host loop slower? This tree against a git revision.

Runs ``bench_scheduler.run_once`` (the nano-vLLM trace through ``schedule`` + ``postprocess``, no
model) on this working tree and on ``--base`` (checked out into a temporary git worktree), each
configuration in its own process, interleaved ``--repeat`` times; keeps the fastest of each
and prints both with their ratio. Steps and preemptions are printed too: equal numbers mean the
two schedulers made the same decisions, so the ratio compares like with like.

    uv run python benchmarks/ab_scheduler.py --base HEAD~5 [--seqs 256] [--repeat 5]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("1M tokens, block 16", 16, 1 << 20),
    ("128K tokens, block 16", 16, 1 << 17),
    ("128K tokens, block 256", 256, 1 << 17),
]
PROGRAM = (
    "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_scheduler import run_once; "
    "print(json.dumps(run_once({block_size}, {pool}, {seqs})))"
)


def run(tree: Path, block_size: int, pool: int, seqs: int) -> dict:
    program = PROGRAM.format(block_size=block_size, pool=pool, seqs=seqs)
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark failed in {tree}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vkv-ab-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True
        )
        try:
            trees = {args.base: base, "this tree": ROOT}
            best: dict[tuple[str, str], dict] = {}
            for _ in range(args.repeat):
                for label, tree in trees.items():
                    for name, block_size, pool in CONFIGS:
                        result = run(tree, block_size, pool, args.seqs)
                        key = (label, name)
                        if (
                            key not in best
                            or result["us_per_seq_step"] < best[key]["us_per_seq_step"]
                        ):
                            best[key] = result
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    table = Table(title=f"scheduler host cost, {args.seqs} sequences, fastest of {args.repeat}")
    for column in (
        "configuration",
        "steps",
        "preemptions",
        "µs/seq-step base",
        "µs/seq-step now",
        "now/base",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for name, _, _ in CONFIGS:
        old, new = best[(args.base, name)], best[("this tree", name)]
        table.add_row(
            name,
            f"{old['steps']} / {new['steps']}",
            f"{old['preemptions']} / {new['preemptions']}",
            f"{old['us_per_seq_step']:.2f}",
            f"{new['us_per_seq_step']:.2f}",
            f"{new['us_per_seq_step'] / old['us_per_seq_step']:.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
