"""The static policy on submitted code: what an editable file may hold, checked before it runs.

``vkv grade`` checks each editable file of a submission against the trusted edition's copy
before any test runs, and each part's tests begin with the same check of that part's regions
(``tests/grading_policy.py``), so that a student meets a refusal the first time the part's tests
run. The rules, read with Python's tokenizer and ``ast`` (never a text search):

- the file is UTF-8 text of at most ``MAX_FILE_BYTES`` that parses, with ``\\n`` as its only
  line break (``regions.py``: one reading of the source), and its solution markers match the
  edition's;
- nothing outside the solution regions differs from the edition;
- a region is the body of the function it sits in: no statement of it at class or module
  level, none that runs past its END marker; it holds at most ``MAX_REGION_NODES`` syntax nodes.

A file that breaks one of these is not graded at all: the edition's file (its stubs) takes its
place, and every part with a region in it scores 0. Inside a region, everything is checked
against closed lists (``region_check.py``; what is not listed is refused, so a door nobody
thought of stays shut), and a region that breaks one costs its own part only: that region
alone is replaced by its stub, "not graded: <rule> at line N of FILE (allowed: ...)", and the
file's other regions are graded as submitted.

- **syntax**: the statement and expression kinds of ``STATEMENTS`` and ``EXPRESSIONS``. No
  ``match``, ``class``, ``global``, ``async``; a nested ``def`` takes no decorators;
- **names**: the function's own parameters and locals, the module's given names (its
  functions, classes and constants, and what it imports from a module the part may import),
  and the builtins of ``[policy] builtins`` in ``parts.toml``; ``super``, ``type``,
  ``getattr`` and ``hasattr`` only in the forms of ``region_check.FORMS``. A module is used only
  through its attributes (``heapq.heappush(...)``, never ``h = heapq``);
- **attributes**, by what the receiver is bound to, never by how it is spelled: on ``self``, what
  its class, its bases or any of its methods' ``self.x = ...`` define, and the public
  vocabulary; on ``super()``, what the bases define and the public vocabulary; on a module, that
  module's own vocabulary (``module_vocabulary``: ``torch.sqrt`` is allowed because Phase 3 lists
  ``sqrt`` among torch's operations, never because ``math`` has one); on anything else, a public
  name of the vocabulary (``vocabulary``: the names the course's given classes and modules
  define, parsed from the trusted tree with the regions stubbed, the public methods of the
  built-in containers, ``[policy] attributes`` and the part's own ``attributes``) or a private
  name the given code defines (``block_manager._device_of``: never ``collections._sys`` or
  ``torch._C``). ``forbidden_attributes`` are refused whatever list holds them, but the part's
  own ``attributes``: a name a part lists is reviewed with that part's imports (part 3.8
  imports only ``triton.language``, whose ``load`` reads one tile of a kernel's own planes);
- **attribute assignment** only on ``self``, a parameter, a local or an object a call made,
  never on a module, a given class or a builtin (``torch.equal = ...``, ``Block.x = ...``), nor
  on a local bound to one of them;
- **strings**: no dunder name, no private identifier, no format field with an attribute or an
  index (``"{0.args[0]}"``);
- **imports**: the modules of ``[policy] imports`` (a module and its submodules) plus those of
  the part's own ``imports``, and from them only names of the module's vocabulary (so never a
  module that a given module imported for itself); no relative import, no private or star
  import.

**What is trusted by its binding, and why each is safe.** The rules above take a few names at
their word; each is trusted only where the region cannot have bound it to something else:

- ``self``: only as the first parameter of a method of a class, and only if nothing in the
  function binds the name again (an assignment, an import alias, a parameter of a lambda or a
  nested def, a ``for``/``with``/``except``/comprehension target, a walrus, ``nonlocal``: each
  is refused). It is then the object the test called the method on, an instance of a given class,
  whose attributes are the class's own;
- a module name: a name bound by ``import`` (in the function, or at module level by the given
  code) and by nothing else in the function (a second binding is refused). A name the function
  binds otherwise is a local, whose attributes are checked against the public vocabulary;
- the module's given names: bound by the given code at module level, read-only to a region
  (attribute assignment on them is refused), shadowed by any local of the same name;
- the builtins: a local or a module-level name of the same spelling is that local (the forms of
  ``super``, ``type``, ``getattr`` and ``hasattr`` apply to the builtin only);
- ``hasattr(obj, name)`` with any name: it answers a bool, never the attribute (``getattr``
  takes a literal name only, checked as the attribute it names);
- ``type(x).__name__``: the one dunder read allowed; it gives a string, and ``type(x)`` may be
  used in no other way, so the class itself never reaches the region;
- ``"literal".format(...)``: the receiver is a string constant, whose fields the string rule
  checked (no attribute or index access); ``format`` on any other object is refused.

Together they keep a region to computing with the objects it is given: it cannot reach the
interpreter, the files, the test process or the grader. What the policy cannot decide
statically (an attribute reached through a container, say), the guard (``reporter.py``) checks
at run time, and the OS sandbox (``sandbox.py``) bounds what an escape could reach.

The check cannot be crashed or stalled by what it reads: a file over ``MAX_FILE_BYTES``, a
region over ``MAX_REGION_NODES`` or any failure of the parser or the walkers
(``RecursionError``, ``MemoryError``...) is a refusal with a message, and each region is read in
a fixed number of passes over its function: time linear in the file's size, measured on a
2-core machine at 0.5 s for a region at the node cap and 6 s for a file at the byte cap.
"""

import ast
import bisect
import collections
import functools
import importlib
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vkv.assignment.region_check import (
    DUNDER,
    MAX_REGION_NODES,
    PRIVATE_IDENTIFIER,
    RegionCheck,
    names_of_class,
    region_nodes,
)
from vkv.assignment.regions import (
    RegionError,
    find_regions,
    restore_regions,
    source_lines,
    stub_regions,
)

MAX_FILE_BYTES = 1 << 20
# Each part's first test (``tests/grading_policy.py``) is named ``test_partN`` + this: the same
# check as the grader's own, for the student; the grader does not count it.
POLICY_TEST_SUFFIX = "_follows_the_grading_policy"
CONTAINERS = (
    list, dict, set, frozenset, tuple, str, bytes, int, float, bool,
    collections.deque, collections.Counter, collections.defaultdict, collections.OrderedDict,
)  # fmt: skip
STRING_FORMATTERS = frozenset({"format", "format_map"})


@dataclass(slots=True, frozen=True, eq=False)
class Policy:
    """What a solution region may import, name and reach (``[policy]`` in parts.toml, and the
    vocabulary of the given code of the tree it was loaded from)."""

    imports: tuple[str, ...] = ()
    builtins: frozenset[str] = frozenset()
    attributes: frozenset[str] = frozenset()
    forbidden_attributes: frozenset[str] = frozenset()
    given_private: frozenset[str] = frozenset()
    part_imports: dict[str, tuple[str, ...]] = field(default_factory=dict)
    part_attributes: dict[str, frozenset[str]] = field(default_factory=dict)
    module_attributes: dict[str, frozenset[str]] = field(default_factory=dict)
    given_modules: dict[str, frozenset[str]] = field(default_factory=dict)
    given_classes: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, data: dict, root: Path | None = None) -> "Policy":
        """The policy of a parsed ``parts.toml``; ``root`` is the tree whose given modules (of
        ``imports`` and ``editable``) add their names to the vocabularies."""
        settings = data.get("policy", {})
        part_imports = {part["id"]: tuple(part.get("imports", [])) for part in data.get("part", [])}
        curated = {name: frozenset(names) for name, names in settings.get("modules", {}).items()}
        imports = tuple(settings.get("imports", [])) + tuple(curated)
        every_import = set(imports).union(*part_imports.values())
        given: set[str] = set()
        given_modules: dict[str, frozenset[str]] = {}
        given_classes: dict[str, frozenset[str]] = {}
        if root is not None:
            all_parts = {part["id"] for part in data.get("part", [])}
            files = {name: _module_file(root, name) for name in sorted(every_import)}
            for path in data.get("assignment", {}).get("editable", []):
                files.setdefault(path.removesuffix(".py").replace("/", "."), root / path)
            for module, file in files.items():
                if file is not None and file.is_file():
                    # the given code only, as a student edition holds it (stubs in the regions)
                    tree = ast.parse(stub_regions(file.read_text(), all_parts, str(file)))
                    given |= _defined_names(tree)
                    given_modules[module] = frozenset(_own_names(tree))
                    for node in tree.body:
                        if isinstance(node, ast.ClassDef):
                            given_classes[node.name] = frozenset(names_of_class(node, reads=True))
        forbidden = frozenset(settings.get("forbidden_attributes", []))
        given |= set(settings.get("attributes", []))
        private = {name for name in given if PRIVATE_IDENTIFIER.fullmatch(name)}
        vocabulary = (given - private) | _container_methods()
        return cls(
            imports=imports,
            builtins=frozenset(settings.get("builtins", [])),
            attributes=frozenset(vocabulary),
            forbidden_attributes=forbidden,
            given_private=frozenset(private - forbidden),
            part_imports=part_imports,
            part_attributes={
                part["id"]: frozenset(part.get("attributes", [])) for part in data.get("part", [])
            },
            module_attributes=curated,
            given_modules=given_modules,
            given_classes=given_classes,
        )

    def allowed_imports(self, part: str) -> tuple[str, ...]:
        return self.imports + self.part_imports.get(part, ())

    def may_import(self, part: str, module: str) -> bool:
        return any(module == ok or module.startswith(ok + ".") for ok in self.allowed_imports(part))

    def vocabulary(self, part: str) -> frozenset[str]:
        """The attribute names a region of ``part`` may use on objects other than modules."""
        own = self.part_attributes.get(part, frozenset())
        return (self.attributes | own) - self.forbidden_for(part) - STRING_FORMATTERS

    def module_vocabulary(self, part: str, module: str) -> frozenset[str]:
        """The attribute names a region of ``part`` may use on the module ``module``: the list
        ``[policy.modules]`` gives it, else the names a given module (``vkv.*``) defines at its
        top level, else a standard-library module's public values (never a module), else (torch,
        Triton, xxhash) the part's own ``attributes``."""
        if module in self.module_attributes:
            names = self.module_attributes[module]
        elif module in self.given_modules:
            names = self.given_modules[module]
        elif module.split(".")[0] in sys.stdlib_module_names:
            names = _module_functions(module)
        else:
            names = self.part_attributes.get(part, frozenset())
        return names - self.forbidden_for(part)

    def forbidden_for(self, part: str) -> frozenset[str]:
        """``forbidden_attributes``, less those the part's own ``attributes`` list by name: a
        part's list is reviewed with its imports (part 3.8's ``load`` is ``triton.language``'s,
        and that part imports no torch, whose ``load`` reads files)."""
        return self.forbidden_attributes - self.part_attributes.get(part, frozenset())


@dataclass(slots=True, frozen=True)
class Violation:
    """The first rule a file or a region breaks, where (a 1-based line), and what is allowed
    instead."""

    path: str
    line: int
    rule: str
    allowed: str = ""

    def __str__(self) -> str:
        said = f"not graded: {self.rule} at line {self.line} of {self.path}"
        return f"{said} (allowed: {self.allowed})" if self.allowed else said


@dataclass(slots=True, frozen=True)
class Verdict:
    """The policy's answer for one file: ``whole_file`` (a rule of the file as a whole, which
    refuses every region in it), else each refused region's first violation by part."""

    whole_file: Violation | None = None
    regions: dict[str, Violation] = field(default_factory=dict)

    @property
    def first(self) -> Violation | None:
        found = [self.whole_file] if self.whole_file else list(self.regions.values())
        return min(found, key=lambda v: v.line, default=None)


def check_file(path: str, data: bytes, edition: str, policy: Policy) -> Verdict:
    """The policy's verdict on the submitted file ``data``; ``edition`` is the trusted copy of
    the same file (the stubs, or the reference). Never raises: whatever the checker cannot read
    is a refusal of the whole file."""
    return _guarded(path, lambda: _verdict(path, data, edition, policy))


def check_part(path: str, text: str, part: str, policy: Policy) -> Verdict:
    """The policy's verdict on the regions of ``part`` in ``text`` alone (no edition to compare
    the rest of the file with): what a part's tests check first (``tests/grading_policy.py``)."""

    def verdict() -> Verdict:
        regions = [region for region in find_regions(text, path) if region.part == part]
        return _region_verdict(path, ast.parse(text, path), regions, policy)

    return _guarded(path, verdict)


def _guarded(path: str, check: Callable[[], Verdict]) -> Verdict:
    """``check()``, or a refusal of the whole file if it raised (the checker itself must not
    be crashed by what it reads)."""
    try:
        return check()
    except (RecursionError, MemoryError) as exc:
        rule = f"code too deeply nested to check ({type(exc).__name__})"
    except Exception as exc:  # a refusal, whatever went wrong
        rule = f"code the policy could not check ({type(exc).__name__}: {str(exc)[:200]})"
    return Verdict(Violation(path, 1, rule))


def _verdict(path: str, data: bytes, edition: str, policy: Policy) -> Verdict:
    if len(data) > MAX_FILE_BYTES:
        return Verdict(Violation(path, 1, f"a file of more than {MAX_FILE_BYTES} bytes"))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return Verdict(Violation(path, line, "the file is not UTF-8 text"))
    try:
        regions = find_regions(text, path)
        tree = ast.parse(text, path)
        restored = restore_regions(edition, text, {r.part for r in regions}, path)
    except SyntaxError as exc:
        return Verdict(Violation(path, exc.lineno or 1, f"a syntax error ({exc.msg})"))
    except ValueError as exc:  # a null byte; RegionError is a ValueError too
        line = re.search(r":(\d+):", str(exc))
        rule = f"solution markers: {exc}" if isinstance(exc, RegionError) else str(exc)
        return Verdict(Violation(path, int(line[1]) if line else 1, rule))
    changed = _first_difference(text, restored)
    if changed is not None:
        return Verdict(Violation(path, changed, "code outside the solution regions changed"))
    return _region_verdict(path, tree, regions, policy)


def _region_verdict(path: str, tree: ast.Module, regions: list, policy: Policy) -> Verdict:
    module_names = _module_names(tree)
    lines, nodes = region_nodes(tree)
    refused: dict[str, Violation] = {}
    for region in regions:
        if region.is_stub or region.part in refused:  # a stub: the edition's own line
            continue
        first, last = region.begin + 2, region.end  # 1-based lines inside the markers
        own = nodes[bisect.bisect_left(lines, first) : bisect.bisect_right(lines, last)]
        if len(own) > MAX_REGION_NODES:
            found = (first, f"a region of {len(own)} syntax nodes", f"at most {MAX_REGION_NODES}")
        else:
            found = RegionCheck(tree, region, policy, module_names, own).first_violation()
        if found is not None:
            line, rule, allowed = found
            refused[region.part] = Violation(
                path, line, f"{rule} in the region of part {region.part}", allowed
            )
    return Verdict(regions=refused)


def graded_text(text: str, edition: str, verdict: Verdict, path: str) -> str:
    """The file as it is graded: the submitted ``text`` with each refused region replaced by
    the edition's (its stub)."""
    kept = {r.part for r in find_regions(edition, path)} - set(verdict.regions)
    return restore_regions(edition, text, kept, path)


def _first_difference(text: str, expected: str) -> int | None:
    """The first line (1-based) where ``text`` and ``expected`` differ, or None."""
    ours, theirs = source_lines(text), source_lines(expected)
    for number, (a, b) in enumerate(zip(ours, theirs, strict=False), start=1):
        if a != b:
            return number
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs)) + 1


def _module_names(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """The names a module's top level binds: name -> (the module it was imported from, or ""
    for a name the module defines itself; the module the name stands for, or None)."""
    names: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = ("", None)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = ("", None)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                names[bound] = (alias.name, alias.name if alias.asname else bound)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module or "", None)
    return names


def _own_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (not those it imports)."""
    return {name for name, (source, _) in _module_names(tree).items() if source == ""}


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a given module defines: its own top-level names, and each class's methods,
    fields, enum members and the attributes its methods set on ``self``."""
    names = _own_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names |= names_of_class(node)
    return {name for name in names if not DUNDER.fullmatch(name)}


def _container_methods() -> set[str]:
    return {
        name
        for kind in CONTAINERS
        for name in dir(kind)
        if not name.startswith("_") and name not in STRING_FORMATTERS
    }


@functools.cache
def _module_functions(name: str) -> frozenset[str]:
    """The public attributes (never a module) of a standard-library module."""
    module = importlib.import_module(name)
    return frozenset(
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_") and not isinstance(value, types.ModuleType)
    )


def _module_file(root: Path, module: str) -> Path | None:
    if not module.startswith("vkv."):
        return None
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
