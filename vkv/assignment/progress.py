"""Which parts of the assignment a tree has not done yet, so the engine can run without them.

A student edition starts with every solution region stubbed, and a student fills them in phase
by phase. The engine must run on what is done: ``vkv demo`` after Phases 1–2, with a 16-bit
cache until Phase 3 is done, caching off until Phase 4 is, and without metrics until Phase 5's
logger is. ``unfinished_parts`` finds the parts that still hold a stub (a region whose body is
exactly the line the release step wrote), reading the editable files of the tree this package
was imported from; ``needed`` turns the first unfinished part an option needs into the error
that option raises.

The error is a ``NotImplementedError`` that starts with the part, as a stub's does
("part 4.5: ..."), so that a graded test that runs the engine reports the part a student has to
write, and the grader counts it as that part not started. A tree without a manifest (an
installed wheel) or with markers the parser refuses counts as done: the stub itself still
raises where it runs.
"""

from functools import lru_cache
from pathlib import Path

from vkv.assignment.parts import Assignment
from vkv.assignment.regions import RegionError, find_regions

PACKAGE_TREE = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=8)
def unfinished_parts(root: Path = PACKAGE_TREE) -> dict[str, tuple[str, str]]:
    """Each part with a stubbed region in the tree at ``root``, in the manifest's order:
    part id -> (the file, the qualified name of its first stubbed function)."""
    try:
        assignment = Assignment.load(root)
    except (FileNotFoundError, ValueError):
        return {}
    stubs: dict[str, tuple[str, str]] = {}
    for name in assignment.editable:
        path = root / name
        try:
            regions = find_regions(path.read_text(), name)
        except (OSError, RegionError, SyntaxError, UnicodeDecodeError):
            continue
        for region in regions:
            if region.is_stub:
                stubs.setdefault(region.part, (name, region.qualname))
    return {part.id: stubs[part.id] for part in assignment.parts if part.id in stubs}


def first_unfinished(
    phases: set[int], files: set[str] | None = None, root: Path = PACKAGE_TREE
) -> tuple[str, str] | None:
    """The first unfinished part of one of ``phases`` (with a region in ``files``, if given):
    (its id, the function), or None when all are done."""
    for part, (name, qualname) in unfinished_parts(root).items():
        if int(part.split(".")[0]) in phases and (files is None or name in files):
            return part, qualname
    return None


def needed(what: str, phases: set[int], files: set[str] | None = None) -> None:
    """Raise the one-line error of ``what`` (an option, a command) when a part of ``phases``
    that it runs is not done yet."""
    unfinished = first_unfinished(phases, files)
    if unfinished is not None:
        part, qualname = unfinished
        phase, number = part.split(".")
        raise NotImplementedError(
            f"part {part}: {qualname} is not done yet, and {what} runs it "
            f"(assignment/phase{phase}.md#part-{number})"
        )
