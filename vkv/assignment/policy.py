"""The static policy on submitted code: what an editable file may hold, checked before it runs.

``vkv grade`` checks each editable file of a submission against the trusted edition's copy
before any test runs. A file that breaks a rule is not graded: the edition's file (its stubs)
takes its place, and every part with a region in it scores 0 with the reason, as
"not graded: <rule> at line N of FILE (allowed: ...)". The rules, read with Python's tokenizer
and ``ast`` (never a text search):

- the file is UTF-8 text that parses, with ``\\n`` as its only line break (``regions.py``: one
  reading of the source), and its solution markers match the edition's;
- nothing outside the solution regions differs from the edition;
- a region is the body of the function it sits in: no statement of it at class or module
  level, none that runs past its END marker.

Inside a region, everything is checked against closed lists (an allowlist: what is not listed
is refused, so a door nobody thought of stays shut):

- **syntax**: the statement and expression kinds of ``STATEMENTS`` and ``EXPRESSIONS``, the
  kinds the reference solutions use plus a few each justified where it is listed. No
  ``match``, ``class``, ``global``/``nonlocal``, ``yield``, ``async``; a ``lambda`` or a nested
  ``def`` takes no default values and no decorators;
- **names**: the function's own parameters and locals, the module's given names (its
  functions, classes and constants, and what it imports from a module the part may import),
  and the builtins of ``[policy] builtins`` in ``parts.toml``. A module is used only through
  its attributes (``heapq.heappush(...)``, never ``h = heapq``);
- **attributes**: on ``self`` (in a method), any attribute but dunders; on anything else, a
  private name only where the given code defines it (``block_manager._device_of``: never
  ``collections._sys`` or ``torch._C``), otherwise a public name from the vocabulary: the names the
  course's given classes and modules define (``vkv.config``, ``vkv.engine.*``...: parsed from
  the trusted tree), the public methods of the built-in containers (``str.format`` and
  ``format_map`` left out: a format field can walk attributes), the public functions of the
  standard-library modules the part may import, ``[policy] attributes``, and the part's own
  ``attributes`` (Phase 3's list of torch operations). ``forbidden_attributes`` are refused
  whatever list holds them, but the part's own ``attributes``: a name a part lists is reviewed
  with that part's imports (part 3.8 imports only ``triton.language``, whose ``load`` reads one
  tile of a kernel's own planes);
- **attribute assignment** only on ``self``, a parameter, a local or an object a call made,
  never on a module, a given class or a builtin (``torch.equal = ...``, ``Block.x = ...``), nor
  on a local bound to one of them;
- **strings**: no dunder name, no private identifier, no format field with an attribute or an
  index (``"{0.args[0]}"``);
- **imports**: the modules of ``[policy] imports`` (a module and its submodules) plus those of
  the part's own ``imports``, and from them only names of the vocabulary (so never a module
  that a given module imported for itself); no relative import, no private or star import.

Together they keep a region to computing with the objects it is given: it cannot reach the
interpreter, the files, the test process or the grader. What the policy cannot decide
statically (an attribute reached through a container, say), the guard (``reporter.py``) checks
at run time, and the OS sandbox (``sandbox.py``) bounds what an escape could reach.
"""

import ast
import collections
import importlib
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from vkv.assignment.regions import (
    Region,
    RegionError,
    find_regions,
    restore_regions,
    source_lines,
    stub_regions,
)

DUNDER = re.compile(r"__\w+__")
PRIVATE_IDENTIFIER = re.compile(r"_\w*")
FORMAT_FIELD_WITH_ACCESS = re.compile(r"\{[^{}]*[.\[]")
CONTAINERS = (
    list, dict, set, frozenset, tuple, str, bytes, int, float, bool,
    collections.deque, collections.Counter, collections.defaultdict, collections.OrderedDict,
)  # fmt: skip
STRING_FORMATTERS = frozenset({"format", "format_map"})

# The syntax a region may use. From the reference solutions, plus: Pass (an empty branch),
# Assert (a student's own invariant check), With (``with torch.no_grad():`` in Phase 3),
# FunctionDef (a small helper, like a sort key) and Lambda (a sort key) without defaults,
# DictComp / Set / NamedExpr (the same power as ListComp, a set display and an assignment).
STATEMENTS = (
    ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.If, ast.For, ast.While, ast.Break,
    ast.Continue, ast.Return, ast.Raise, ast.Try, ast.Delete, ast.Import, ast.ImportFrom,
    ast.Pass, ast.Assert, ast.With, ast.FunctionDef,
)  # fmt: skip
EXPRESSIONS = (
    ast.Attribute, ast.BinOp, ast.BoolOp, ast.Call, ast.Compare, ast.Constant, ast.Dict,
    ast.FormattedValue, ast.GeneratorExp, ast.IfExp, ast.JoinedStr, ast.List, ast.ListComp,
    ast.Name, ast.SetComp, ast.Slice, ast.Starred, ast.Subscript, ast.Tuple, ast.UnaryOp,
    ast.DictComp, ast.Set, ast.NamedExpr, ast.Lambda,
)  # fmt: skip
PIECES = (
    ast.ExceptHandler, ast.keyword, ast.comprehension, ast.arguments, ast.arg, ast.alias,
    ast.withitem, ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop,
)  # fmt: skip
SYNTAX_NAMES = {
    "Match": "a match statement",
    "ClassDef": "a class definition",
    "Global": "a global declaration",
    "Nonlocal": "a nonlocal declaration",
    "Yield": "yield",
    "YieldFrom": "yield from",
    "Await": "await",
    "AsyncFunctionDef": "an async function",
    "AsyncFor": "async for",
    "AsyncWith": "async with",
    "TryStar": "try/except*",
}
ALLOWED_SYNTAX = (
    "assignments, expressions, if, for, while, break, continue, return, raise, try/except, "
    "with, assert, del, pass, import, comprehensions, lambda and def without defaults"
)


@dataclass(slots=True, frozen=True)
class Policy:
    """What a solution region may import, name and reach (``[policy]`` in parts.toml, and the
    vocabulary of the given code of the tree it was loaded from)."""

    imports: tuple[str, ...] = ()
    builtins: frozenset[str] = frozenset()
    attributes: frozenset[str] = frozenset()
    forbidden_attributes: frozenset[str] = frozenset()
    given_private: frozenset[str] = frozenset()
    part_imports: tuple[tuple[str, tuple[str, ...]], ...] = ()
    part_attributes: tuple[tuple[str, frozenset[str]], ...] = ()

    @classmethod
    def from_manifest(cls, data: dict, root: Path | None = None) -> "Policy":
        """The policy of a parsed ``parts.toml``; ``root`` is the tree whose given modules (of
        ``imports`` and ``editable``) add their public names to the attribute vocabulary."""
        settings = data.get("policy", {})
        imports = tuple(settings.get("imports", []))
        part_imports = tuple(
            (part["id"], tuple(part.get("imports", []))) for part in data.get("part", [])
        )
        every_import = set(imports).union(*(own for _, own in part_imports))
        given: set[str] = set()
        if root is not None:
            all_parts = {part["id"] for part in data.get("part", [])}
            files = [_module_file(root, name) for name in sorted(every_import)]
            files += [root / path for path in data.get("assignment", {}).get("editable", [])]
            for file in files:
                if file is not None and file.is_file():
                    # the given code only, as a student edition holds it (stubs in the regions)
                    text = stub_regions(file.read_text(), all_parts, str(file))
                    given |= _defined_names(ast.parse(text, str(file)))
        private = {name for name in given if PRIVATE_IDENTIFIER.fullmatch(name)}
        vocabulary = (given - private) | _container_methods() | _module_functions(imports)
        vocabulary |= set(settings.get("attributes", []))
        return cls(
            imports=imports,
            builtins=frozenset(settings.get("builtins", [])),
            attributes=frozenset(vocabulary),
            forbidden_attributes=frozenset(settings.get("forbidden_attributes", [])),
            given_private=frozenset(private - set(settings.get("forbidden_attributes", []))),
            part_imports=part_imports,
            part_attributes=tuple(
                (
                    part["id"],
                    frozenset(part.get("attributes", []))
                    | _module_functions(part.get("imports", [])),
                )
                for part in data.get("part", [])
            ),
        )

    def allowed_imports(self, part: str) -> tuple[str, ...]:
        return self.imports + dict(self.part_imports).get(part, ())

    def may_import(self, part: str, module: str) -> bool:
        return any(module == ok or module.startswith(ok + ".") for ok in self.allowed_imports(part))

    def vocabulary(self, part: str) -> frozenset[str]:
        """The attribute names a region of ``part`` may use on objects other than ``self``."""
        own = dict(self.part_attributes).get(part, frozenset())
        return (self.attributes | own) - self.forbidden_for(part) - STRING_FORMATTERS

    def forbidden_for(self, part: str) -> frozenset[str]:
        """``forbidden_attributes``, less those the part's own ``attributes`` list by name: a
        part's list is reviewed with its imports (part 3.8's ``load`` is ``triton.language``'s,
        and that part imports no torch, whose ``load`` reads files)."""
        own = dict(self.part_attributes).get(part, frozenset())
        return self.forbidden_attributes - own


@dataclass(slots=True, frozen=True)
class Violation:
    """The first rule a file breaks, where (a 1-based line), and what is allowed instead."""

    path: str
    line: int
    rule: str
    allowed: str = ""

    def __str__(self) -> str:
        said = f"not graded: {self.rule} at line {self.line} of {self.path}"
        return f"{said} (allowed: {self.allowed})" if self.allowed else said


def check_file(path: str, data: bytes, edition: str, policy: Policy) -> Violation | None:
    """The first violation of the policy in the submitted file ``data``, or None.

    ``edition`` is the trusted copy of the same file (the stubs, or the reference).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Violation(path, data[: exc.start].count(b"\n") + 1, "the file is not UTF-8 text")
    try:
        regions = find_regions(text, path)
        tree = ast.parse(text, path)
        restored = restore_regions(edition, text, {r.part for r in regions}, path)
    except SyntaxError as exc:
        return Violation(path, exc.lineno or 1, f"a syntax error ({exc.msg})")
    except ValueError as exc:  # a null byte; RegionError is a ValueError too
        line = re.search(r":(\d+):", str(exc))
        rule = f"solution markers: {exc}" if isinstance(exc, RegionError) else str(exc)
        return Violation(path, int(line[1]) if line else 1, rule)
    changed = _first_difference(text, restored)
    if changed is not None:
        return Violation(path, changed, "code outside the solution regions changed")
    module_names = _module_names(tree)
    for region in regions:
        if region.is_stub:  # the edition's own line (its message may name ``__init__``)
            continue
        found = RegionCheck(tree, region, policy, module_names).first_violation()
        if found is not None:
            line, rule, allowed = found
            return Violation(path, line, f"{rule} in the region of part {region.part}", allowed)
    return None


def _first_difference(text: str, expected: str) -> int | None:
    """The first line (1-based) where ``text`` and ``expected`` differ, or None."""
    ours, theirs = source_lines(text), source_lines(expected)
    for number, (a, b) in enumerate(zip(ours, theirs, strict=False), start=1):
        if a != b:
            return number
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs)) + 1


Found = tuple[int, str, str]  # line, rule, what is allowed instead


class RegionCheck:
    """One region of a file checked against the allowlists (see the module docstring)."""

    def __init__(
        self,
        tree: ast.Module,
        region: Region,
        policy: Policy,
        module_names: dict[str, tuple[str, bool]],
    ) -> None:
        self.part = region.part
        self.policy = policy
        self.first, self.last = region.begin + 2, region.end  # 1-based lines inside the markers
        self.tree = tree
        self.vocabulary = policy.vocabulary(region.part)
        self.function, self.is_method = _enclosing_function(tree, region.begin + 1)
        self.parents = {
            child: node for node in ast.walk(self.function) for child in ast.iter_child_nodes(node)
        }
        self.locals = _bound_names(self.function)
        # module-level names this part may use; True where the name is a module
        self.given = {
            name: is_module
            for name, (source, is_module) in module_names.items()
            if source == "" or policy.may_import(self.part, source)
        }
        imports = [n for n in ast.walk(self.function) if isinstance(n, ast.Import | ast.ImportFrom)]
        self.imported = {
            alias.asname or alias.name.split(".")[0] for n in imports for alias in n.names
        }
        self.local_modules = {
            alias.asname or alias.name.split(".")[0]
            for node in imports
            if isinstance(node, ast.Import)
            for alias in node.names
        }

    def first_violation(self) -> Found | None:
        for node in ast.walk(self.tree):
            line = getattr(node, "lineno", None)
            if line is None or not self.first <= line <= self.last:
                continue
            found = self._rule_broken(node)
            if found is not None:
                return (line, *found) if isinstance(found, tuple) else (line, found, "")
        return None

    def _rule_broken(self, node: ast.AST) -> str | tuple[str, str] | None:
        if (node.end_lineno or node.lineno) > self.last:
            return "a statement that runs past the END marker"
        if node not in self.parents:  # outside the function: it would run on import
            return "a statement at class or module level"
        if not isinstance(node, STATEMENTS + EXPRESSIONS + PIECES):
            name = type(node).__name__
            return f"{SYNTAX_NAMES.get(name, f'the syntax {name}')} is not allowed", ALLOWED_SYNTAX
        if isinstance(node, ast.FunctionDef | ast.Lambda):
            return self._function_rule(node)
        if isinstance(node, ast.Import | ast.ImportFrom):
            return self._import_rule(node)
        if isinstance(node, ast.Name):
            return self._name_rule(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_rule(node)
        if isinstance(node, ast.keyword | ast.arg):
            name = node.arg
            return f"the dunder name {name}" if name and DUNDER.fullmatch(name) else None
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            # A piece of an f-string ("_total" in f"vkv_{stem}_total") names nothing by itself.
            return _string_rule(node.value, isinstance(self.parents.get(node), ast.JoinedStr))
        return None

    def _function_rule(self, node: ast.FunctionDef | ast.Lambda) -> str | None:
        args = node.args
        if args.defaults or any(d is not None for d in args.kw_defaults):
            return "a default value of a lambda or a nested def"
        if isinstance(node, ast.FunctionDef):
            if node.decorator_list:
                return "a decorator"
            if DUNDER.fullmatch(node.name):
                return f"the dunder name {node.name}"
        return None

    def _import_rule(self, node: ast.Import | ast.ImportFrom) -> str | tuple[str, str] | None:
        if isinstance(node, ast.ImportFrom) and node.level:
            return "a relative import"
        modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        modules += [alias.name for alias in node.names if isinstance(node, ast.Import)]
        allowed = ", ".join(self.policy.allowed_imports(self.part))
        for module in modules:
            if not self.policy.may_import(self.part, module):
                return f"an import of {module}, which is not allowed here", allowed
        for alias in node.names:
            for name in (alias.name.split(".")[-1], alias.asname):
                private = PRIVATE_IDENTIFIER.fullmatch(name or "")
                if name == "*" or (private and name not in self.policy.given_private):
                    return f"an import of the name {name}"
            vocabulary = self.vocabulary | self.policy.given_private
            if isinstance(node, ast.ImportFrom) and alias.name not in vocabulary:
                return f"an import of the name {alias.name}, which {node.module} does not give"
        return None

    def _name_rule(self, node: ast.Name) -> str | tuple[str, str] | None:
        name = node.id
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        if isinstance(node.ctx, ast.Store | ast.Del):
            return None
        known = name in self.locals or name in self.given or name in self.policy.builtins
        if not known:
            names = sorted(self.locals | set(self.given) | self.policy.builtins)
            return f"`{name}` is not allowed", ", ".join(names)
        is_module = name in self.local_modules or (
            name not in self.locals and self.given.get(name, False)
        )
        parent = self.parents.get(node)
        if is_module and not (isinstance(parent, ast.Attribute) and parent.value is node):
            return f"the module {name} used as a value (use its attributes: {name}.<name>)"
        return None

    def _attribute_rule(self, node: ast.Attribute) -> str | tuple[str, str] | None:
        name = node.attr
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        if name in self.policy.forbidden_for(self.part):
            return f"the forbidden attribute {name}"
        on_self = self.is_method and isinstance(node.value, ast.Name) and node.value.id == "self"
        if not on_self and name not in self.policy.given_private:
            if PRIVATE_IDENTIFIER.fullmatch(name):
                return f"the private attribute {name} of an object other than self"
            if name not in self.vocabulary:
                return f"the attribute `{name}` is not allowed", (
                    "any attribute of self; on other objects, the public names of the given "
                    "classes, the methods of list, dict, set, deque and str (not format), and "
                    f"[policy] attributes and part {self.part}'s attributes in "
                    "assignment/parts.toml"
                )
        if isinstance(node.ctx, ast.Store | ast.Del):
            return self._assignment_rule(node)
        return None

    def _assignment_rule(self, node: ast.Attribute) -> str | None:
        """An attribute may be set on self, a parameter, a local or what a call made, never on
        a module, a given class or function, or a builtin, nor on a local bound to one."""
        root: ast.AST = node.value
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        if isinstance(root, ast.Call):
            return None
        if not isinstance(root, ast.Name) or root.id not in self.locals - self.imported:
            owner = root.id if isinstance(root, ast.Name) else type(root).__name__
            return f"setting an attribute of {owner}, which this function does not own"
        for value in self._values_bound_to(root.id):
            chain_root = value
            while isinstance(chain_root, ast.Attribute):
                chain_root = chain_root.value
            if isinstance(chain_root, ast.Name) and chain_root.id not in self.locals:
                return (
                    f"setting an attribute of {root.id}, bound to {chain_root.id} "
                    "(a module, a given class or a builtin)"
                )
        return None

    def _values_bound_to(self, name: str) -> list[ast.expr]:
        values = []
        for node in ast.walk(self.function):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                values.append(node.value)
            elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                target = node.target
                if isinstance(target, ast.Name) and target.id == name:
                    values.append(node.value)
        return values


def _string_rule(value: str | bytes, piece: bool = False) -> str | None:
    text = value if isinstance(value, str) else value.decode("latin-1")
    if DUNDER.search(text):
        return "a dunder name in a string"
    if PRIVATE_IDENTIFIER.fullmatch(text) and text != "_" and not piece:
        return "a string that names a private attribute"
    if FORMAT_FIELD_WITH_ACCESS.search(text):
        return "a format field with an attribute or an index in a string"
    return None


def _enclosing_function(tree: ast.Module, line: int) -> tuple[ast.FunctionDef, bool]:
    """The innermost function around ``line``, and whether it is a method taking ``self``."""
    found: tuple[ast.FunctionDef, bool] | None = None

    def visit(node: ast.AST, in_class: bool) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    args = child.args.posonlyargs + child.args.args
                    method = in_class and bool(args) and args[0].arg == "self"
                    found = (child, method)  # type: ignore[assignment]
                    visit(child, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, True)

    visit(tree, False)
    if found is None:
        raise RegionError(f"line {line}: a region must lie inside a function")
    return found


def _bound_names(function: ast.FunctionDef) -> set[str]:
    """Every name the function binds: parameters, assignment and loop targets, imports..."""
    names: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.FunctionDef) and node is not function:
            names.add(node.name)
    return names


def _module_names(tree: ast.Module) -> dict[str, tuple[str, bool]]:
    """The names a module's top level binds: name -> (the module it was imported from, or ""
    for a name the module defines itself; whether the name is a module)."""
    names: dict[str, tuple[str, bool]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = ("", False)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = ("", False)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (alias.name, True)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module or "", False)
    return names


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a given module defines: its functions, classes and constants, and each class's
    methods, fields, enum members and the attributes its methods set on ``self``."""
    names: set[str] = set()
    bodies = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for statement in (statement for body in bodies for statement in body):
        if isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif _sets_on_self(node):
            names.add(node.attr)
    return {name for name in names if not DUNDER.fullmatch(name)}


def _sets_on_self(node: ast.AST) -> bool:
    """Whether ``node`` is a ``self.<name> = ...`` target."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _container_methods() -> set[str]:
    return {
        name
        for kind in CONTAINERS
        for name in dir(kind)
        if not name.startswith("_") and name not in STRING_FORMATTERS
    }


def _module_functions(modules: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The public attributes (never a module) of the standard-library modules listed."""
    found: set[str] = set()
    for name in modules:
        if name.split(".")[0] not in sys.stdlib_module_names:
            continue
        module = importlib.import_module(name)
        found |= {
            attr
            for attr, value in vars(module).items()
            if not attr.startswith("_") and not isinstance(value, types.ModuleType)
        }
    return frozenset(found)


def _module_file(root: Path, module: str) -> Path | None:
    if not module.startswith("vkv."):
        return None
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
