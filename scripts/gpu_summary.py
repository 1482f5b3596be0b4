"""The summary of ``scripts/gpu_check.sh``: its stages' results gathered into
``OUT/gpu_check.json``, and printed. Exits 1 when a stage did not finish cleanly or a test
failed.

    python3 scripts/gpu_summary.py OUT
"""

import datetime
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_decode_kernel import options_text  # a sweep row's launch options in words

COLLECTION_ERROR = re.compile(r"^_+ ERROR collecting (\S+) _+$", re.M)
ERROR_LINE = re.compile(r"^E\s+(.+)$", re.M)


def read_stages(out: Path) -> dict[str, dict[str, int]]:
    """Each stage's exit status and seconds (``stages.txt``: one "name status seconds" line)."""
    stages = {}
    for line in (out / "stages.txt").read_text().splitlines():
        name, status, seconds = line.split()
        stages[name] = {"exit_status": int(status), "seconds": int(seconds)}
    return stages


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def first_line(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0][:200]


def read_tests(out: Path) -> dict | None:
    """Passed, failed, skipped from pytest's JUnit report (None without one), the failures'
    first lines, and the files pytest could not import (``not_run``: file -> why)."""
    junit = out / "tests.xml"
    if not junit.is_file():
        return None
    tests = {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": [], "not_run": {}}
    for case in ET.parse(junit).iter("testcase"):
        problem = case.find("failure")
        problem = case.find("error") if problem is None else problem
        if case.find("skipped") is not None:
            tests["skipped"] += 1
        elif problem is None:
            tests["passed"] += 1
        elif not case.get("classname"):  # a file that could not be imported: see the log
            tests["not_run"][case.get("name")] = first_line(problem.get("message"))
        else:
            tests["failed"] += 1
            test_id = f"{case.get('classname')}::{case.get('name')}"
            tests["failed_tests"].append(f"{test_id}: {first_line(problem.get('message'))}")
    log = out / "tests.log"
    if log.is_file():  # pytest's own account of the files it could not import, with the reason
        tests["not_run"] = {}
        sections = COLLECTION_ERROR.split(log.read_text())
        for path, body in zip(sections[1::2], sections[2::2], strict=True):
            reason = ERROR_LINE.search(body)
            tests["not_run"][path] = first_line(reason[1]) if reason else "collection error"
    return tests


def unclean(stages: dict[str, dict[str, int]], tests: dict | None) -> list[str]:
    """The stages that did not finish cleanly. pytest exits non-zero for a file it could not
    import too: the tests stage is clean when its report exists and no test failed."""
    bad = [name for name, stage in stages.items() if name != "tests" and stage["exit_status"]]
    if tests is None or tests["failed"]:
        bad.insert(0, "tests")
    return bad


def report(result: dict) -> None:
    print(f"gpu_check: {result['device']}, torch {result['torch']}, triton {result['triton']}")
    tests = result["tests"]
    if tests is None:
        print("tests: no report (the stage did not finish)")
    else:
        counts = ", ".join(f"{tests[key]} {key}" for key in ("passed", "failed", "skipped"))
        print(f"tests: {counts}")
        for failed in tests["failed_tests"]:
            print(f"  FAILED {failed}")
        for path, why in tests["not_run"].items():
            print(f"  not run: {path}: {why}")
    if result["startup"]:
        print(f"LLM() started in {result['startup']['llm_startup_seconds']:.1f} s")
    for row in (result["decode_kernel"] or {}).get("rows", []):
        share = row["share_of_copy_bandwidth"]
        print(f"  {row['kernel']:>32}: {row['ms']:.3f} ms, {share:.1%} of copy bandwidth")
    best = {}  # each format's fastest launch options (rows come fastest first)
    for row in (result["decode_sweep"] or {}).get("rows", []):
        best.setdefault(row["format"], row)
    for name, row in best.items():
        print(
            f"  {name:>32}: fastest at {options_text(row)}: {row['ms']:.3f} ms "
            f"({row['speedup_over_defaults']:.2f}x the defaults)"
        )
    for name, row in (result["decode_step"] or {}).items():
        busy, step = row["gpu_busy_share"], row["full_decode_step_ms"]
        print(
            f"  {name:>24}: {row['tokens_per_s']:,.0f} tokens/s, full decode step "
            f"{'-' if step is None else f'{step:.2f} ms'}, GPU busy "
            f"{'unmeasured' if busy is None else format(busy, '.1%')}"
        )
    e2e = result["e2e"]
    if e2e:
        busy = e2e["gpu_busy_share"]
        print(
            f"e2e ({e2e['requests']} requests): vkv {e2e['vkv_tokens_per_s']:,.0f} tokens/s, "
            f"transformers {e2e['hf_tokens_per_s']:,.0f} ({e2e['speedup']:.2f}x); start-up "
            f"{e2e['startup_seconds']:.1f} s; GPU busy "
            f"{'unmeasured' if busy is None else format(busy, '.1%')} of a full decode step"
        )
    host = result["host"]
    if host:
        phases = host["phases_us"]
        work = host["step_us"] - phases["sample"]  # the sample phase waits for the GPU
        print(
            f"host ({host['batch']} sequences): a full decode step {host['step_us']:,.0f} us, "
            f"{phases['sample']:,.0f} us of it in sample (the wait for the GPU), "
            f"{work:,.0f} us the host's work"
        )
        print("  " + ", ".join(f"{p} {us:,.0f}" for p, us in phases.items() if p != "sample"))
    print(f"stages that did not finish cleanly: {', '.join(result['unclean']) or 'none'}")


def main(out: Path) -> int:
    stages = read_stages(out)
    tests = read_tests(out)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "stages": stages,
        "unclean": unclean(stages, tests),
        "tests": tests,
        "startup": read_json(out / "startup.json"),
        "decode_kernel": read_json(out / "decode_kernel.json"),
        "decode_sweep": read_json(out / "decode_sweep.json"),
        "decode_step": read_json(out / "decode_step.json"),
        "e2e": read_json(out / "e2e.json"),
        "host": read_json(out / "bench_step_overhead.json"),
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"all figures: {out / 'gpu_check.json'}")
    return 1 if result["unclean"] else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
