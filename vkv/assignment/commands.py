"""The handlers of ``vkv grade`` and ``vkv assignment release|solve|check|gradescope``: the
command line's options turned into calls of ``grade``, ``release``, ``solve``, ``check`` and
``package``, and their results printed (``vkv/cli.py`` builds the parser).

The ``assignment`` commands read the reference from the tree this package was installed from,
or from ``--root``; a student edition, which holds no reference code, is refused.
"""

import argparse
import time
from pathlib import Path

from rich.console import Console

from vkv.assignment.parts import MANIFEST, Assignment


def grade_command(args: argparse.Namespace, console: Console) -> int:
    """Grade, printing a line a part to stderr as it ends (a long grade shows it is alive, and
    stdout keeps only the form asked for), then the form."""
    from vkv.assignment import report
    from vkv.assignment.grade import grade

    started = time.monotonic()
    status = Console(stderr=True, highlight=False)

    def progress(result, isolated) -> None:
        line = report.progress_line(result, isolated, time.monotonic() - started)
        status.print(line, markup=False, soft_wrap=True)

    if (args.hidden or args.format == "gradescope") and not (
        args.require_sandbox or args.unsafe_no_sandbox
    ):
        used = "--hidden" if args.hidden else "--format gradescope"
        raise ValueError(
            f"{used} makes a grade, and a grade needs the sandbox: add --require-sandbox (it "
            "refuses to grade where bubblewrap cannot run), or --unsafe-no-sandbox to get a "
            "progress check that a submission could have cheated"
        )
    result = grade(
        Path(args.path).resolve(),
        Path(args.trusted).resolve() if args.trusted else None,
        hidden=Path(args.hidden).resolve() if args.hidden else None,
        reference=reference_root(args) if args.isolate else None,
        timeout=args.timeout,
        require_sandbox=args.require_sandbox,
        unsafe_no_sandbox=args.unsafe_no_sandbox,
        seed=args.seed,
        progress=progress,
        parts=Assignment.load(Path(args.trusted or args.path)).expand(args.parts)
        if args.parts
        else None,
    )
    if args.format == "table":
        report.print_table(result, console)
        return 0
    render = {
        "json": report.as_json,
        "gradescope": report.as_gradescope,
        "classroom": report.as_classroom,
    }
    text = render.get(args.format, report.as_markdown)(result)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text if text.endswith("\n") else text + "\n")
        report.print_table(result, console)  # the file is for a machine; the table for a person
    else:
        print(text)
    return 0


def release_command(args: argparse.Namespace, console: Console) -> int:
    from vkv.assignment.release import release

    out = Path(args.out).resolve()
    files = release(reference_root(args), out, classroom=args.classroom)
    console.print(f"wrote the student edition ({len(files)} files, one commit) to {out}")
    if args.classroom:
        console.print("with .github/workflows/classroom.yml (GitHub Classroom's autograding)")
    return 0


def solve_command(args: argparse.Namespace, console: Console) -> int:
    from vkv.assignment.release import solve

    root = reference_root(args)
    parts = Assignment.load(root).expand(args.parts)
    changed = solve(root, Path(args.dir).resolve(), parts)
    console.print(f"reference code for parts {', '.join(sorted(parts))} written to:")
    for path in changed:
        console.print(f"  {path}")
    return 0


def check_command(args: argparse.Namespace, console: Console) -> int:
    from vkv.assignment.check import check

    findings = check(reference_root(args), console)
    return 0 if all(finding.ok for finding in findings) else 1


def gradescope_command(args: argparse.Namespace, console: Console) -> int:
    from vkv.assignment.gradescope import package

    root = reference_root(args)
    parts = Assignment.load(root).expand(args.parts) if args.parts else None
    out = Path(args.out).resolve()
    names = package(root, out, parts)
    graded = f"parts {', '.join(sorted(parts))}" if parts else "every part"
    console.print(f"wrote the Gradescope autograder ({len(names)} files; grades {graded}): {out}")
    return 0


def reference_root(args: argparse.Namespace) -> Path:
    """The instructor's reference tree: ``--root``, else the tree this package runs from."""
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parents[2]
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(
            f"no reference tree at {root} ({MANIFEST} missing); pass --root REFERENCE"
        )
    if Assignment.load(root).edition == "student":
        raise ValueError(
            f"{root} is a student edition: it holds no reference code, so `vkv grade --isolate` "
            "and `vkv assignment release|solve|check` cannot run from it. Instructors: pass "
            "--root with the reference repository. Students: `uv run vkv grade` (without "
            "--isolate) scores your tree."
        )
    return root
