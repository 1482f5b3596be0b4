"""Solution regions: the one mechanism that turns the reference solution into the assignment.

A graded module marks each piece of reference code with nbgrader-style markers that name the
part it belongs to: a line ``### BEGIN SOLUTION part1.3`` before it and a line
``### END SOLUTION`` after it, indented like the code, inside a function whose docstring states
the contract. Stubbing a region replaces its body with one line and keeps the markers, so the
region can be found again (to grade it, or to put the reference back):

    raise NotImplementedError("part 1.3: BlockManager.can_allocate — assignment/phase1.md#part-3")

Rules: markers stand alone on their line; regions do not nest; each region lies inside a
function, whose qualified name the stub reports.

One reading of the source: a file is a sequence of lines separated by ``\n`` and nothing else.
A file that holds another character Python or ``str.splitlines`` would take for a line break
(``\r``, ``\x0b``, ``\x0c``, ``\x1c``–``\x1e``, U+0085, U+2028, U+2029) is refused with a
``RegionError`` naming the character and its line: with two readings, the lines a policy checks
need not be the lines the parser runs. Markers are the *comments* the tokenizer finds (the same
tokenizer that gives the AST its line numbers), never text in a string, and every rebuild splits
and joins on ``\n`` only, so that what is not replaced comes out byte for byte.
"""

import ast
import io
import re
import textwrap
import tokenize
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

BEGIN_MARKER = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION part(?P<part>\d+\.\d+)[ \t]*$")
END_MARKER = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
MARKER_COMMENT = re.compile(r"### (BEGIN|END) SOLUTION")
OTHER_LINE_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


class RegionError(ValueError):
    """A file's solution markers are malformed, or two trees' regions do not correspond."""


@dataclass(slots=True, frozen=True)
class Region:
    """One solution region of a file: lines ``begin`` and ``end`` are its markers (0-based)."""

    part: str
    qualname: str
    indent: str
    begin: int
    end: int
    body: tuple[str, ...]

    @property
    def phase(self) -> int:
        return int(self.part.split(".")[0])

    @property
    def number(self) -> int:
        return int(self.part.split(".")[1])

    @property
    def stub_line(self) -> str:
        """The single line a stubbed region holds."""
        where = f"assignment/phase{self.phase}.md#part-{self.number}"
        return (
            f'{self.indent}raise NotImplementedError("part {self.part}: {self.qualname} — {where}")'
        )

    @property
    def is_stub(self) -> bool:
        return self.body == (self.stub_line,)

    def dedented_body(self) -> str:
        return textwrap.dedent("\n".join(self.body))


def find_regions(text: str, filename: str = "<text>") -> list[Region]:
    """Every solution region of a Python source, in order; ``RegionError`` on bad markers or on
    a line break other than ``\\n``; ``SyntaxError`` if it does not parse."""
    lines = source_lines(text, filename)
    function_at = _enclosing_functions(text, filename)
    regions: list[Region] = []
    open_at: int | None = None
    for number in _marker_lines(text, lines, filename):
        line = lines[number]
        begin = BEGIN_MARKER.match(line)
        if begin:
            if open_at is not None:
                raise RegionError(f"{filename}:{number + 1}: region opened inside another region")
            open_at, part, indent = number, begin["part"], begin["indent"]
        elif END_MARKER.match(line):
            if open_at is None:
                raise RegionError(f"{filename}:{number + 1}: END SOLUTION without BEGIN")
            qualname = function_at.get(open_at)
            if qualname is None:
                raise RegionError(f"{filename}:{open_at + 1}: a region must lie inside a function")
            body = tuple(lines[open_at + 1 : number])
            regions.append(Region(part, qualname, indent, open_at, number, body))
            open_at = None
        else:
            raise RegionError(f"{filename}:{number + 1}: malformed marker {line.strip()!r}")
    if open_at is not None:
        raise RegionError(f"{filename}:{open_at + 1}: region never closed")
    return regions


def source_lines(text: str, filename: str = "<text>") -> list[str]:
    """The lines of ``text`` split on ``\\n`` (the last one empty if it ends in one), or
    ``RegionError`` if any other line break is in it."""
    other = OTHER_LINE_BREAKS.search(text)
    if other is not None:
        line = text.count("\n", 0, other.start()) + 1
        char = other[0]
        name = f"U+{ord(char):04X} {unicodedata.name(char, repr(char))}"
        if text.startswith("\r\n", other.start()):
            name = "\\r\\n (Windows line endings)"
        raise RegionError(
            f"{filename}:{line}: a line break other than \\n: {name}; the grader reads only \\n "
            "line endings (save the file with LF line endings and without that character)"
        )
    return text.split("\n")


def _marker_lines(text: str, lines: list[str], filename: str) -> list[int]:
    """The 0-based lines whose only token is a comment that looks like a marker."""
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    try:
        for token in tokens:
            if token.type == tokenize.COMMENT and MARKER_COMMENT.match(token.string):
                row, column = token.start
                if lines[row - 1][:column].strip():
                    raise RegionError(f"{filename}:{row}: a marker must stand alone on its line")
                found.append(row - 1)
    except tokenize.TokenError as exc:
        raise SyntaxError(f"{filename}: {exc.args[0]}") from exc
    return found


def rewrite_regions(
    text: str, replace: Callable[[int, Region], list[str] | None], filename: str = "<text>"
) -> str:
    """Rebuild ``text`` with the body of region i replaced by ``replace(i, region)``.

    ``replace`` returns the new body lines, or None to keep the region as it is.
    """
    lines = source_lines(text, filename)
    out: list[str] = []
    cursor = 0
    for index, region in enumerate(find_regions(text, filename)):
        new_body = replace(index, region)
        if new_body is None:
            continue
        out.extend(lines[cursor : region.begin + 1])
        out.extend(new_body)
        cursor = region.end
    out.extend(lines[cursor:])
    return "\n".join(out)


def stub_regions(text: str, parts: set[str], filename: str = "<text>") -> str:
    """Stub every region of the given parts."""
    return rewrite_regions(
        text,
        lambda _, region: [region.stub_line] if region.part in parts else None,
        filename,
    )


def restore_regions(text: str, reference: str, parts: set[str], filename: str = "<text>") -> str:
    """Put the reference bodies back into the regions of the given parts.

    The two files must have the same regions (parts and functions, in order).
    """
    theirs = find_regions(text, filename)
    ours = find_regions(reference, filename)
    signature = [(r.part, r.qualname) for r in theirs]
    if signature != [(r.part, r.qualname) for r in ours]:
        raise RegionError(
            f"{filename}: its solution regions differ from the reference's; was a marker moved "
            "or deleted?"
        )
    return rewrite_regions(
        text,
        lambda index, region: list(ours[index].body) if region.part in parts else None,
        filename,
    )


def _enclosing_functions(text: str, filename: str) -> dict[int, str]:
    """Map each 0-based line to the qualified name of the innermost function around it."""
    tree = ast.parse(text, filename)
    owner: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                for line in range(child.lineno - 1, child.end_lineno or child.lineno):
                    owner[line] = name
                visit(child, f"{name}.")

    visit(tree, "")
    return owner
