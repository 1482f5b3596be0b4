"""``vkv assignment check``: prove that the assignment is sound, all parts at once.

It builds the student edition in a temporary folder and verifies:

1. the edition holds no reference code: every region is a stub, no region body appears in any
   of its files, and its git history is a single commit;
2. the edition imports (every module of ``vkv``);
3. the public signatures of the edition equal the reference's;
4. every graded test belongs to a part of ``parts.toml``, and every part has tests;
5. every graded test passes on the reference;
6. every graded test fails on the edition, with the NotImplementedError of its own part or of
   a part it depends on;
7. for each part, stubbing that part alone fails all of its tests, and every test of a part
   that does not depend on it still passes;
8. hidden tests (``tests/hidden/``, left out of the edition) obey rules 4 to 7 too;
9. every mutant of ``assignment/mutants.toml`` (a plausible wrong implementation) lies in a
   region of the part it names and fails at least one graded test *of that part*: the tests are
   strong enough to catch it, and a grade (``--isolate`` included) blames the part whose code is
   wrong, not a part that merely runs it.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.assignment.parts import Assignment
from vkv.assignment.regions import find_regions
from vkv.assignment.release import copy_tree, release, source_files, stub_tree
from vkv.assignment.testrun import TestResult, TestRun, run_many
from vkv.threads import usable_cpus

MUTANTS = Path("assignment") / "mutants.toml"
RUN_TIMEOUT_S = 300.0
HIDDEN = Path("tests") / "hidden"
STUB_ERROR = re.compile(r"NotImplementedError: part (?P<part>\d+\.\d+):")


@dataclass(slots=True, frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str


@dataclass(slots=True, frozen=True)
class Mutant:
    """A wrong implementation of ``part``: ``find`` replaced by ``replace`` in ``file``."""

    part: str
    file: str
    why: str
    find: str
    replace: str


def load_mutants(root: Path) -> list[Mutant]:
    path = root / MUTANTS
    if not path.is_file():
        return []
    return [Mutant(**entry) for entry in tomllib.loads(path.read_text()).get("mutant", [])]


def check(root: Path, console: Console) -> list[Finding]:
    """Run every check on the reference tree ``root``; print and return the findings."""
    assignment = Assignment.load(root)
    findings: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="vkv-check-") as scratch:
        trees = {"reference": Path(scratch) / "reference", "edition": Path(scratch) / "edition"}
        files = release(root, trees["edition"])
        copy_tree(root, trees["reference"], files)
        for part in assignment.part_ids:
            trees[part] = Path(scratch) / f"stub-{part}"
            copy_tree(root, trees[part], files)
            stub_tree(trees[part], assignment, {part})
        mutants = load_mutants(root)
        misplaced, mutant_trees = {}, {}
        for index, mutant in enumerate(mutants):
            tree = Path(scratch) / f"mutant-{index}"
            copy_tree(root, tree, files)
            problem = _apply(mutant, tree)
            if problem:
                misplaced[index] = f"mutant {index} ({mutant.why}): {problem}"
            else:
                mutant_trees[index] = tree
        findings += _no_reference_code(root, trees["edition"], assignment)
        findings.append(_imports(trees["edition"]))
        findings.append(_same_signatures(trees["reference"], trees["edition"]))

        hidden = sorted(p.relative_to(root).as_posix() for p in (root / HIDDEN).glob("test_*.py"))
        every_tree = [*trees.values(), *mutant_trees.values()]
        for tree in every_tree:  # hidden tests: same rules
            copy_tree(root, tree, hidden)
        test_files = assignment.test_files + hidden
        _share_rewritten_tests(trees["reference"], every_tree, test_files)

        workers = usable_cpus()
        console.print(f"running the graded tests in {len(trees)} trees, {workers} at a time")
        results = _run_timed(
            {name: TestRun(tree, tuple(test_files)) for name, tree in trees.items()},
            workers,
            console,
        )
        hung = [name for name, result in results.items() if result is None]
        if hung:
            findings.append(Finding("every test run finishes", False, _summary(hung)))
            _print(findings, console)
            return findings

        on_reference = results["reference"]
        part_ids = assignment.part_ids
        findings += _every_test_has_a_part(assignment, on_reference)
        failing = [r.nodeid for r in on_reference if r.outcome != "passed"]
        findings.append(
            Finding("reference passes every graded test", not failing, _summary(failing))
        )
        findings.append(_all_fail_with_stub_errors(assignment, on_reference, results["edition"]))
        for part in assignment.part_ids:
            affected = assignment.dependents(part) | {part}
            findings.append(_part_isolated(part, affected, on_reference, results[part]))

        # A mutant needs one failing test of its own part: run those only, up to the first
        # failure (a tenth of the work of a full run).
        own_tests = {p: [r.nodeid for r in on_reference if r.part == p] for p in part_ids}
        console.print(f"running each of {len(mutant_trees)} mutants on its own part's tests")
        caught = _run_timed(
            {
                index: TestRun(tree, tuple(own_tests[mutants[index].part]), ("-x",))
                for index, tree in mutant_trees.items()
            },
            workers,
            console,
            label="mutant ",
        )
        survivors = [_survivor(index, mutants[index], results) for index, results in caught.items()]
        survivors = [survivor for survivor in survivors if survivor]
        findings.append(
            Finding(
                "every mutant fails a graded test of its own part",
                not survivors and not misplaced,
                _summary([*misplaced.values(), *survivors])
                if survivors or misplaced
                else f"{len(mutants)} caught, each by its own part's tests",
            )
        )
    _print(findings, console)
    return findings


def _run_timed(
    runs: dict[Hashable, TestRun], workers: int, console: Console, label: str = ""
) -> dict[Hashable, list[TestResult] | None]:
    """``run_many``'s results (None: a run crashed or hung), with a line of the time taken: the
    wall time, the runs' summed time and the slowest runs (``label`` and key), so that a
    slowdown shows where."""
    seconds: dict[Hashable, float] = {}
    started = time.monotonic()
    results = run_many(runs, workers, RUN_TIMEOUT_S, seconds.__setitem__)
    slowest = sorted(seconds, key=seconds.__getitem__, reverse=True)[:3]
    console.print(
        f"  {len(runs)} runs in {time.monotonic() - started:.0f} s "
        f"({sum(seconds.values()):.0f} s of runs; slowest: "
        + ", ".join(f"{label}{key} {seconds[key]:.0f} s" for key in slowest)
        + ")"
    )
    return results


def _share_rewritten_tests(reference: Path, trees: list[Path], test_files: list[str]) -> None:
    """Have pytest rewrite the graded test modules' asserts once, in ``reference``, and give
    every tree the cached result (``tests/**/__pycache__/*-pytest-*.pyc``): the trees' test
    files are the reference's, times included (``copy2``), so each of the check's hundreds of
    runs loads them instead of rewriting them again."""
    collect = ["-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"]
    subprocess.run(
        [sys.executable, *collect, *test_files],
        cwd=reference,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        | {"PYTHONPATH": str(reference)},
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    caches = [cache.relative_to(reference) for cache in reference.glob("tests/**/*-pytest-*.pyc")]
    for tree in (tree for tree in trees if tree != reference):
        for cache in caches:
            (tree / cache).parent.mkdir(exist_ok=True)
            shutil.copy2(reference / cache, tree / cache)


def _apply(mutant: Mutant, tree: Path) -> str | None:
    """Apply the mutant to ``tree``; what is wrong with it (None: applied)."""
    file = tree / mutant.file
    text = file.read_text()
    if text.count(mutant.find) != 1:
        return "find text not found exactly once"
    start = text[: text.index(mutant.find)].count("\n")
    end = start + mutant.find.rstrip("\n").count("\n")
    parts = {r.part for r in find_regions(text, mutant.file) if r.begin < start and end < r.end}
    if parts != {mutant.part}:
        where = f"part {', '.join(sorted(parts))}'s region" if parts else "no region"
        return f"names part {mutant.part} but its find text lies in {where}"
    file.write_text(text.replace(mutant.find, mutant.replace))
    return None


def _survivor(index: int, mutant: Mutant, results: list[TestResult] | None) -> str | None:
    """Why the mutant survived, or None if a test of its own part caught it.

    A run that hangs (None) has caught it: the grader's timeout fails the part.
    """
    if results is None:
        return None
    if any(r.outcome != "passed" and r.part == mutant.part for r in results):
        return None
    return (
        f"mutant {index} of part {mutant.part} ({mutant.why}): no test of part {mutant.part} fails"
    )


def _no_reference_code(root: Path, edition: Path, assignment: Assignment) -> list[Finding]:
    bodies = []
    leftovers = []
    for path in assignment.editable:
        bodies += [r.dedented_body() for r in find_regions((root / path).read_text(), path)]
        leftovers += [
            f"{path}:{r.begin + 1}"
            for r in find_regions((edition / path).read_text(), path)
            if not r.is_stub
        ]
    leaked = []
    for path in source_files(edition):
        text = (edition / path).read_text(errors="replace")
        flat = "\n".join(line.strip() for line in text.splitlines())
        for body in bodies:
            if "\n".join(line.strip() for line in body.splitlines()) in flat:
                leaked.append(path)
                break
    commits = subprocess.run(
        ["git", "rev-list", "--count", "HEAD"], cwd=edition, capture_output=True, text=True
    ).stdout.strip()
    return [
        Finding("every region of the edition is a stub", not leftovers, _summary(leftovers)),
        Finding("no reference code in the edition's files", not leaked, _summary(leaked)),
        Finding("the edition's history is one commit", commits == "1", f"{commits} commit(s)"),
    ]


def _imports(edition: Path) -> Finding:
    program = (
        "import pkgutil, vkv, importlib, pathlib, sys\n"
        f"assert pathlib.Path(vkv.__file__).is_relative_to({str(edition)!r}), vkv.__file__\n"
        "for m in pkgutil.walk_packages(vkv.__path__, 'vkv.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(edition), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=edition, env=env, capture_output=True, text=True
    )
    detail = "all modules import" if done.returncode == 0 else done.stderr.strip()[-500:]
    return Finding("the edition imports", done.returncode == 0, detail)


def _same_signatures(reference: Path, edition: Path) -> Finding:
    differ = []
    for path in sorted(reference.glob("vkv/**/*.py")):
        relative = path.relative_to(reference)
        ours = _signatures(path.read_text())
        theirs = _signatures((edition / relative).read_text())
        differ += [
            f"{relative}:{name}"
            for name in sorted(ours.keys() | theirs.keys())
            if ours.get(name) != theirs.get(name)
        ]
    return Finding("public signatures equal the reference's", not differ, _summary(differ))


def _signatures(text: str) -> dict[str, str]:
    """Qualified name -> a canonical rendering of each class and function's signature."""
    found: dict[str, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                bases = ", ".join(ast.unparse(base) for base in child.bases)
                found[prefix + child.name] = f"class({bases})"
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                decorators = " ".join(ast.unparse(d) for d in child.decorator_list)
                returns = ast.unparse(child.returns) if child.returns else ""
                found[prefix + child.name] = (
                    f"{decorators} ({ast.unparse(child.args)}) -> {returns}"
                )

    visit(ast.parse(text), "")
    return {
        name: sig
        for name, sig in found.items()
        if not name.rsplit(".", 1)[-1].startswith("_") or name.endswith("__")
    }


def _every_test_has_a_part(assignment: Assignment, results: list[TestResult]) -> list[Finding]:
    orphans = [r.nodeid for r in results if r.part not in assignment.part_ids]
    empty = [p for p in assignment.part_ids if not any(r.part == p for r in results)]
    return [
        Finding("every graded test belongs to a part", not orphans, _summary(orphans)),
        Finding("every part has graded tests", not empty, _summary(empty)),
    ]


def _all_fail_with_stub_errors(
    assignment: Assignment, reference: list[TestResult], edition: list[TestResult]
) -> Finding:
    outcome = {r.nodeid: r for r in edition}
    wrong = []
    for test in reference:
        result = outcome.get(test.nodeid)
        if result is None:
            wrong.append(f"{test.nodeid} (did not run)")
            continue
        if result.outcome == "passed":
            wrong.append(f"{test.nodeid} (passed on the stubs)")
            continue
        stub = STUB_ERROR.search(result.message)
        known = test.part in assignment.part_ids
        allowed = {test.part} | assignment.prerequisites(test.part) if known else set()
        if stub is None or stub["part"] not in allowed:
            wrong.append(f"{test.nodeid} (failed without the NotImplementedError of its parts)")
    return Finding(
        "every graded test fails on the edition with its part's NotImplementedError",
        not wrong,
        _summary(wrong) if wrong else f"{len(reference)} tests fail",
    )


def _part_isolated(
    part: str, affected: set[str], reference: list[TestResult], stubbed: list[TestResult]
) -> Finding:
    outcome = {r.nodeid: r.outcome for r in stubbed}
    wrong = []
    for test in reference:
        result = outcome.get(test.nodeid, "did not run")
        if test.part == part and result == "passed":
            wrong.append(f"{test.nodeid} passed with its part stubbed")
        elif test.part not in affected and result != "passed":
            wrong.append(
                f"{test.nodeid} ({result}) although part {test.part} does not depend on {part}"
            )
    return Finding(
        f"stubbing part {part} fails its tests and only its dependents'", not wrong, _summary(wrong)
    )


def _summary(items: Iterable[str]) -> str:
    items = list(items)
    if not items:
        return "ok"
    shown = "; ".join(items[:5])
    return shown + (f"; and {len(items) - 5} more" if len(items) > 5 else "")


def _print(findings: list[Finding], console: Console) -> None:
    table = Table(title="vkv assignment check")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for finding in findings:
        mark = "[green]ok[/green]" if finding.ok else "[red]FAIL[/red]"
        table.add_row(finding.check, mark, finding.detail)
    console.print(table)
