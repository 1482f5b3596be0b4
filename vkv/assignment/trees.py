"""The trees a grade reads and writes: a tree's files (less version control, caches, virtual
environments and links), copies of them, the files a submission changed outside its editable
ones, and a fingerprint of a whole tree, taken before and after a grade, that tells whether
anything wrote to the trusted tree meanwhile.
"""

import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vkv.assignment.parts import Assignment

SKIPPED_NAMES = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}


def submitted_file(submission: Path, path: str) -> Path | None:
    """The submission's file at ``path``, or None if it is missing or reached through a link."""
    file = submission / path
    if not file.is_file() or file.resolve() != submission.resolve() / path:
        return None
    return file


def protected_changes(submission: Path, trusted: Path, assignment: Assignment) -> list[str]:
    """Files of the submission, outside ``editable``, that are new or differ from ``trusted``,
    and every symbolic link in it (never followed)."""
    if submission.resolve() == trusted.resolve():
        return []
    ours = tree_files(trusted)
    changed = [f"{link} (symbolic link)" for link in symbolic_links(submission)]
    for path, file in tree_files(submission).items():
        if path in assignment.editable:
            continue
        original = ours.get(path)
        if original is None or original.read_bytes() != file.read_bytes():
            changed.append(path)
    return changed


def tree_files(root: Path) -> dict[str, Path]:
    """Every file under ``root`` by relative path, less version control, caches, venvs and
    symbolic links (a submitted link could point anywhere)."""
    found = {}
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_NAMES)
        for name in names:
            path = Path(directory) / name
            if not name.endswith(".pyc") and not path.is_symlink():
                found[path.relative_to(root).as_posix()] = path
    return found


def symbolic_links(root: Path) -> list[str]:
    """Every symbolic link under ``root`` (to a file or a folder), by relative path."""
    links = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_NAMES]
        for name in subdirs + names:
            path = Path(directory) / name
            if path.is_symlink():
                links.append(path.relative_to(root).as_posix())
    return sorted(links)


def tree_state(root: Path) -> dict[str, str]:
    """Every path under ``root``, links included, with a fingerprint: the content's sha256 for
    each file of ``tree_files``, ``_metadata_fingerprint`` for the rest (version control,
    virtual environments, caches: too large to read each time)."""
    state = {}
    content = tree_files(root)
    for directory, subdirs, names in os.walk(root):
        for name in names + [d for d in subdirs if Path(directory, d).is_symlink()]:
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            if relative in content:
                state[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                state[relative] = _metadata_fingerprint(path.lstat())
    return state


def _metadata_fingerprint(info: os.stat_result) -> str:
    """What a write to a file changes: its inode, mode, size and mtime, and its ctime when the
    file has one name only.

    A file with several hard links shares its inode, and so its ctime and link count, with
    names outside the tree: uv links a virtual environment's files to its shared cache, and
    every other environment that links the same cached file changes that ctime. Those files
    are fingerprinted without it, so that no other process's activity voids a grade; a write
    that also sets the mtime back is then unseen (the sandbox keeps a submission from writing
    anything outside its own tree).
    """
    ctime = info.st_ctime_ns if info.st_nlink == 1 else "linked"
    return f"{info.st_ino} {info.st_mode} {info.st_size} {info.st_mtime_ns} {ctime}"


def first_change(before: dict[str, str], after: dict[str, str]) -> str | None:
    """The first path, in sorted order, written, added or removed between two ``tree_state``s."""
    changed = sorted(
        path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
    )
    return changed[0] if changed else None


def copy_clean(
    source: Path, target: Path, leave_out: str | None = None, test_caches: bool = False
) -> None:
    """Copy the files of ``tree_files(source)``, times included, less the folder ``leave_out``
    if given; with ``test_caches``, also the modules pytest rewrote under ``tests/`` (its
    ``__pycache__/*-pytest-*.pyc``, valid while the source's size and time are the same), so
    that a test process in ``target`` loads them rather than rewriting each test module."""
    files = tree_files(source)
    if test_caches:
        files |= {
            cache.relative_to(source).as_posix(): cache
            for cache in source.glob("tests/**/__pycache__/*-pytest-*.pyc")
        }
    for path, file in files.items():
        if leave_out is not None and path.startswith(leave_out + "/"):
            continue
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target / path)


@contextmanager
def no_bytecode_written() -> Iterator[None]:
    """While inside, this process writes no ``.pyc`` file: what a grade imports as it goes (rich's
    modules when it first prints progress, say) must not land in the trusted tree, whose virtual
    environment it may be running from, between the tree's two fingerprints."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        yield
    finally:
        sys.dont_write_bytecode = before
