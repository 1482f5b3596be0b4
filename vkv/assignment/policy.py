"""The static policy on submitted code: what an editable file may hold, checked before it runs.

``vkv grade`` checks each editable file of a submission against the trusted edition's copy
before any test runs. A file that breaks a rule is not graded: the edition's file (its stubs)
takes its place, and every part with a region in it scores 0 with the reason, as
"not graded: <rule> at line N". The rules, read with Python's ``ast`` (never a text search):

- the file is UTF-8 text that parses, and its solution markers match the edition's;
- nothing outside the solution regions differs from the edition;
- a region is the body of the function it sits in: no statement of it at class or module
  level (such a statement would run on import, outside any test);
- a region imports only the modules of ``[policy] imports`` in ``parts.toml`` (a module and
  its submodules), plus those of its part's own ``imports``; no relative import;
- a region never names a forbidden builtin (``exec``, ``open``, ``getattr``...), a forbidden
  module (``sys``, ``os``, ``inspect``, ``gc``, ``pytest``... unless its part imports it), a
  forbidden attribute (frames, tracebacks, pytest's items), nor anything written like a dunder
  (``__class__``, ``__globals__``, ``__subclasses__``, ``__dict__``..., in a name, an attribute,
  a keyword or a string); it defines no class and declares no ``global`` or ``nonlocal``.

The lists live in ``parts.toml`` so that each phase extends them (Phase 3's quantizer imports
``torch``). Together they keep a region to computing with the objects it is given: it cannot
reach the interpreter, the files, the test process or the grader. What the policy cannot see,
the OS sandbox (``sandbox.py``) bounds: a region that escapes anyway still finds no reference
code, no other tree and no way out of its run.
"""

import ast
import re
from dataclasses import dataclass

from vkv.assignment.regions import Region, RegionError, find_regions, restore_regions

DUNDER = re.compile(r"__\w+__")


@dataclass(slots=True, frozen=True)
class Policy:
    """What a solution region may import and must never name (``[policy]`` in parts.toml)."""

    imports: tuple[str, ...] = ()
    part_imports: tuple[tuple[str, tuple[str, ...]], ...] = ()
    forbidden_names: frozenset[str] = frozenset()
    forbidden_modules: frozenset[str] = frozenset()
    forbidden_attributes: frozenset[str] = frozenset()

    @classmethod
    def from_manifest(cls, data: dict) -> "Policy":
        settings = data.get("policy", {})
        return cls(
            imports=tuple(settings.get("imports", [])),
            part_imports=tuple(
                (part["id"], tuple(part.get("imports", []))) for part in data.get("part", [])
            ),
            forbidden_names=frozenset(settings.get("forbidden_names", [])),
            forbidden_modules=frozenset(settings.get("forbidden_modules", [])),
            forbidden_attributes=frozenset(settings.get("forbidden_attributes", [])),
        )

    def allowed_imports(self, part: str) -> tuple[str, ...]:
        return self.imports + dict(self.part_imports).get(part, ())

    def forbidden_identifiers(self, part: str) -> frozenset[str]:
        """Names a region of ``part`` may not use as a name or an attribute."""
        own = {module.split(".")[0] for module in dict(self.part_imports).get(part, ())}
        return self.forbidden_names | (self.forbidden_modules - own)


@dataclass(slots=True, frozen=True)
class Violation:
    """The first rule a file breaks, and where (a 1-based line)."""

    path: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"not graded: {self.rule} at line {self.line} of {self.path}"


def check_file(path: str, data: bytes, edition: str, policy: Policy) -> Violation | None:
    """The first violation of the policy in the submitted file ``data``, or None.

    ``edition`` is the trusted copy of the same file (the stubs, or the reference).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Violation(path, data[: exc.start].count(b"\n") + 1, "the file is not UTF-8 text")
    try:
        tree = ast.parse(text, path)
        regions = find_regions(text, path)
        restored = restore_regions(edition, text, {r.part for r in regions}, path)
    except SyntaxError as exc:
        return Violation(path, exc.lineno or 1, f"a syntax error ({exc.msg})")
    except RegionError as exc:
        line = re.search(r":(\d+):", str(exc))
        return Violation(path, int(line[1]) if line else 1, f"solution markers: {exc}")
    changed = _first_difference(text, restored)
    if changed is not None:
        return Violation(path, changed, "code outside the solution regions changed")
    nodes = _nodes(tree)
    for region in regions:
        if region.is_stub:  # the edition's own line (its message may name ``__init__``)
            continue
        found = _check_region(nodes, region, policy)
        if found is not None:
            line, rule = found
            return Violation(path, line, f"{rule} in the region of part {region.part}")
    return None


def _first_difference(text: str, expected: str) -> int | None:
    """The first line (1-based) where ``text`` and ``expected`` differ, or None."""
    ours, theirs = text.splitlines(), expected.splitlines()
    for number, (a, b) in enumerate(zip(ours, theirs, strict=False), start=1):
        if a != b:
            return number
    if len(ours) != len(theirs) or text.endswith("\n") != expected.endswith("\n"):
        return min(len(ours), len(theirs)) + 1
    return None


def _check_region(
    nodes: list[tuple[ast.AST, bool]], region: Region, policy: Policy
) -> tuple[int, str] | None:
    """The first rule the region's code breaks, with its line (``nodes``: ``_nodes``)."""
    first, last = region.begin + 2, region.end  # 1-based lines between the markers
    inside = [node for node in nodes if first <= getattr(node[0], "lineno", 0) <= last]
    forbidden = policy.forbidden_identifiers(region.part)
    allowed = policy.allowed_imports(region.part)
    for node, in_function in inside:
        found = _rule_broken(node, in_function, forbidden, allowed, policy)
        if found is not None:
            return node.lineno, found
    return None


def _nodes(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every node of the tree, with whether it lies inside a function."""
    found: list[tuple[ast.AST, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            found.append((child, in_function))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def _rule_broken(
    node: ast.AST,
    in_function: bool,
    forbidden: frozenset[str],
    allowed: tuple[str, ...],
    policy: Policy,
) -> str | None:
    """The rule ``node`` breaks, or None."""
    if isinstance(node, ast.stmt) and not in_function:
        return "a statement at class or module level"
    if isinstance(node, ast.ClassDef):
        return "a class definition"
    if isinstance(node, ast.Global | ast.Nonlocal):
        return "a global or nonlocal declaration"
    if isinstance(node, ast.Import | ast.ImportFrom):
        return _import_rule(node, forbidden, allowed)
    for name in _identifiers(node):
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        if name in forbidden:
            return f"the forbidden name {name}"
        if isinstance(node, ast.Attribute) and name in policy.forbidden_attributes:
            return f"the forbidden attribute {name}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
        if DUNDER.search(text):
            return "a dunder name in a string"
    return None


def _import_rule(
    node: ast.Import | ast.ImportFrom, forbidden: frozenset[str], allowed: tuple[str, ...]
) -> str | None:
    if isinstance(node, ast.ImportFrom) and node.level:
        return "a relative import"
    modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
    modules += [alias.name for alias in node.names if isinstance(node, ast.Import)]
    for module in modules:
        if not any(module == ok or module.startswith(ok + ".") for ok in allowed):
            return f"an import of {module}, which is not allowed here"
    for alias in node.names:
        for name in (alias.name.split(".")[0], alias.asname):
            if name and (name in forbidden or DUNDER.fullmatch(name) or name == "*"):
                return f"an import of the forbidden name {name}"
    return None


def _identifiers(node: ast.AST) -> list[str]:
    """The names a node spells out: a name, an attribute, a keyword, an argument."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.keyword):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [node.name]
    return []
