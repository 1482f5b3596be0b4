"""One solution region checked against the policy's allowlists (the rules: ``policy.py``).

A ``RegionCheck`` reads the region's function once: which names it binds and how (an import, a
parameter, an assignment...), the class it is a method of, and the nodes between the markers.
Each node is then judged on its own against those facts, so the check is linear in the size of
the file, and a region of more than ``MAX_REGION_NODES`` syntax nodes is refused before any rule
is tried.
"""

import ast
import re
from collections.abc import Iterator

from vkv.assignment.regions import Region, RegionError

MAX_REGION_NODES = 20_000

DUNDER = re.compile(r"__\w+__")
PRIVATE_IDENTIFIER = re.compile(r"_\w*")
FORMAT_FIELD_WITH_ACCESS = re.compile(r"\{[^{}]*[.\[]")

# The syntax a region may use. From the reference solutions, plus: Pass (an empty branch),
# Assert (a student's own invariant check), With (``with torch.no_grad():`` in Phase 3),
# FunctionDef (a small helper, like a sort key) and Lambda (a sort key), whose default values
# are expressions checked like any other; DictComp / Set / NamedExpr (the same power as
# ListComp, a set display and an assignment); Nonlocal (it binds a name of the enclosing
# function, never of the module); Yield / YieldFrom (a generator helper: a generator's frame
# and code are forbidden attributes).
STATEMENTS = (
    ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.If, ast.For, ast.While, ast.Break,
    ast.Continue, ast.Return, ast.Raise, ast.Try, ast.Delete, ast.Import, ast.ImportFrom,
    ast.Pass, ast.Assert, ast.With, ast.FunctionDef, ast.Nonlocal,
)  # fmt: skip
EXPRESSIONS = (
    ast.Attribute, ast.BinOp, ast.BoolOp, ast.Call, ast.Compare, ast.Constant, ast.Dict,
    ast.FormattedValue, ast.GeneratorExp, ast.IfExp, ast.JoinedStr, ast.List, ast.ListComp,
    ast.Name, ast.SetComp, ast.Slice, ast.Starred, ast.Subscript, ast.Tuple, ast.UnaryOp,
    ast.DictComp, ast.Set, ast.NamedExpr, ast.Lambda, ast.Yield, ast.YieldFrom,
)  # fmt: skip
PIECES = (
    ast.ExceptHandler, ast.keyword, ast.comprehension, ast.arguments, ast.arg, ast.alias,
    ast.withitem, ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop,
)  # fmt: skip
SYNTAX_NAMES = {
    "Match": "a match statement",
    "ClassDef": "a class definition",
    "Global": "a global declaration",
    "Await": "await",
    "AsyncFunctionDef": "an async function",
    "AsyncFor": "async for",
    "AsyncWith": "async with",
    "TryStar": "try/except*",
}
SYNTAX_INSTEAD = {
    "ClassDef": "a helper is a nested function; a record is a tuple, a dict or "
    "collections.namedtuple",
    "Global": "nonlocal, or state kept on self: a region changes no module-level name",
}
ALLOWED_SYNTAX = (
    "assignments, expressions, if, for, while, break, continue, return, raise, try/except, "
    "with, assert, del, pass, import, nonlocal, comprehensions, lambda, yield and def without "
    "decorators"
)
# Builtins a region may call in one form only, each checked where it is used.
FORMS = {
    "super": "super() with no arguments, in a method, followed by an attribute",
    "type": "type(x).__name__",
    "getattr": "getattr(obj, 'name') or getattr(obj, 'name', default), with a literal name",
    "hasattr": "hasattr(obj, name): it answers a bool, never the attribute",
}
ATTRIBUTES_ALLOWED = (
    "on self, what its class defines; on a module, what the module offers (policy.py); on "
    "other objects, the public names of the given classes, the methods of list, dict, set, "
    "deque and str, and [policy] attributes and the part's attributes in assignment/parts.toml"
)

Found = tuple[str, str]  # the rule broken, what is allowed instead ("" if nothing to say)


class RegionCheck:
    """One region of a parsed file against the policy (see ``policy.py``)."""

    def __init__(
        self,
        tree: ast.Module,
        region: Region,
        policy,
        module_names: dict,
        nodes: list[ast.AST],
    ) -> None:
        """``nodes``: the file's nodes on the region's lines (``region_nodes``)."""
        self.part = region.part
        self.policy = policy
        self.last = region.end  # the END marker's line (1-based)
        self.function, self.owner = _enclosing_function(tree, region.begin + 1)
        self.parents, self.bindings, self.modules, unevaluated = _read_function(self.function)
        self.nodes = [node for node in nodes if id(node) not in unevaluated]
        # module-level names this part may use: name -> the module it is, or None
        self.given = {
            name: module
            for name, (source, module) in module_names.items()
            if source == "" or policy.may_import(self.part, source)
        }
        args = self.function.args.posonlyargs + self.function.args.args
        self.self_trusted = (
            self.owner is not None and bool(args) and args[0].arg == "self"
        ) and self.bindings.get("self") == [args[0]]
        self.super_attributes = _base_names(tree, self.owner, policy.given_classes)
        self.self_attributes = self.super_attributes | (
            names_of_class(self.owner) if self.owner else set()
        )
        self.object_vocabulary = policy.vocabulary(self.part)

    def first_violation(self) -> tuple[int, str, str] | None:
        """(line, rule, allowed) of the region's first violation, or None."""
        rebinding = next(
            (node for node in self.nodes if "self" in _names_bound_by(node, self.function)), None
        )
        if rebinding is not None:  # said first: every attribute on it is then refused too
            return rebinding.lineno, self._binding_rule("self") or "", ""
        for node in self.nodes:
            found = self._rule_broken(node)
            if found is not None:
                rule, allowed = found if isinstance(found, tuple) else (found, "")
                return node.lineno, rule, allowed
        return None

    def _rule_broken(self, node: ast.AST) -> str | Found | None:
        if (node.end_lineno or node.lineno) > self.last:
            return "a statement that runs past the END marker"
        if node not in self.parents:  # outside the function: it would run on import
            return "a statement at class or module level"
        if not isinstance(node, STATEMENTS + EXPRESSIONS + PIECES):
            name = type(node).__name__
            said = SYNTAX_NAMES.get(name, f"the syntax {name}")
            return f"{said} is not allowed", SYNTAX_INSTEAD.get(name, ALLOWED_SYNTAX)
        if isinstance(node, ast.FunctionDef):
            return self._function_rule(node)
        if isinstance(node, ast.Import | ast.ImportFrom):
            return self._import_rule(node)
        if isinstance(node, ast.Name):
            return self._name_rule(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_rule(node)
        if isinstance(node, ast.Call):
            return self._call_rule(node)
        if isinstance(node, ast.keyword | ast.arg):
            return self._binding_rule(node.arg) if node.arg else None
        if isinstance(node, ast.Nonlocal):
            return next(filter(None, map(self._binding_rule, node.names)), None)
        if isinstance(node, ast.ExceptHandler) and node.name:
            return self._binding_rule(node.name)
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            # A piece of an f-string ("_total" in f"vkv_{stem}_total") names nothing by itself.
            return _string_rule(node.value, isinstance(self.parents.get(node), ast.JoinedStr))
        return None

    def _binding_rule(self, name: str, by_import: bool = False) -> str | None:
        """A name the region binds: never a dunder, never ``self`` (it names the method's
        object), and a name an import binds is bound by nothing else (it names a module)."""
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        if name == "self":
            return "binding the name self (it names the method's object only; use another name)"
        if name in self.modules and not by_import:
            return f"binding the module name {name} to something else"
        return None

    def _function_rule(self, node: ast.FunctionDef) -> str | None:
        if node.decorator_list:
            return "a decorator"
        return self._binding_rule(node.name)

    def _import_rule(self, node: ast.Import | ast.ImportFrom) -> str | Found | None:
        if isinstance(node, ast.ImportFrom) and node.level:
            return "a relative import"
        modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        modules += [alias.name for alias in node.names if isinstance(node, ast.Import)]
        allowed = ", ".join(self.policy.allowed_imports(self.part))
        for module in modules:
            if not self.policy.may_import(self.part, module):
                return f"an import of {module}, which is not allowed here", allowed
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            found = self._binding_rule(bound, by_import=isinstance(node, ast.Import))
            if found is not None:
                return found
            for name in (alias.name.split(".")[-1], alias.asname):
                private = PRIVATE_IDENTIFIER.fullmatch(name or "")
                if name == "*" or (private and name not in self.policy.given_private):
                    return f"an import of the name {name}"
            if isinstance(node, ast.ImportFrom) and not self._module_offers(
                node.module or "", alias.name
            ):
                return f"an import of the name {alias.name}, which {node.module} does not give"
        return None

    def _module_offers(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` is allowed: a name of the module's vocabulary
        (a submodule too, where the vocabulary lists it: ``from torch.nn import functional``)."""
        offered = self.policy.module_vocabulary(self.part, module)
        return name in offered and name not in self.policy.forbidden_for(self.part)

    def _name_rule(self, node: ast.Name) -> str | Found | None:
        name = node.id
        if isinstance(node.ctx, ast.Store | ast.Del):
            return self._binding_rule(name)
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        known = (
            name in self.bindings
            or name in self.given
            or name in self.policy.builtins
            or name in FORMS
        )
        if not known:
            names = sorted(set(self.bindings) | set(self.given) | self.policy.builtins)
            return f"`{name}` is not allowed", ", ".join(names)
        parent = self.parents.get(node)
        if self._module_named(node) is not None and not (
            isinstance(parent, ast.Attribute) and parent.value is node
        ):
            return f"the module {name} used as a value (use its attributes: {name}.<name>)"
        if name in FORMS and name not in self.bindings and name not in self.given:
            is_called = isinstance(parent, ast.Call) and parent.func is node
            return None if is_called else (f"{name} used as a value", FORMS[name])
        return None

    def _module_named(self, node: ast.expr) -> str | None:
        """The module a name stands for (an import in the function, or one at module level
        that the function does not rebind), or None."""
        if not isinstance(node, ast.Name):
            return None
        if node.id in self.bindings:
            return self.modules.get(node.id)
        return self.given.get(node.id)

    def _attribute_rule(self, node: ast.Attribute) -> str | Found | None:
        name, value = node.attr, node.value
        if name == "__name__" and _is_type_call(value) and isinstance(node.ctx, ast.Load):
            return None  # type(x).__name__: a class's name, a string
        if DUNDER.fullmatch(name):
            return f"the dunder name {name}"
        if name in self.policy.forbidden_for(self.part):
            return f"the forbidden attribute {name}"
        found = self._receiver_rule(value, name)
        if found is None and isinstance(node.ctx, ast.Store | ast.Del):
            return self._assignment_rule(node)
        return found

    def _receiver_rule(self, value: ast.expr, name: str) -> str | Found | None:
        """Whether the object ``value`` may be asked for its attribute ``name``."""
        if name == "format" and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return None  # "...".format(...): its fields were checked with the string
        private = PRIVATE_IDENTIFIER.fullmatch(name) is not None
        module = self._module_named(value)
        if module is not None:
            whose, allowed = (
                f"the module {module}",
                (name in self.policy.module_vocabulary(self.part, module)),
            )
        elif _is_super_call(value) or (
            isinstance(value, ast.Name) and value.id == "self" and self.self_trusted
        ):
            offered = self.super_attributes if _is_super_call(value) else self.self_attributes
            whose = "super()" if _is_super_call(value) else "self"
            allowed = name in offered or self._offered_by_any(name, private)
        else:
            whose = "an object other than self"
            allowed = self._offered_by_any(name, private)
        if allowed:
            return None
        if private:
            return f"the private attribute {name} of {whose}"
        if name in ("format", "format_map"):
            return f"the attribute {name} of {whose}", "an f-string, or str.format on a literal"
        return f"the attribute `{name}` of {whose} is not allowed", ATTRIBUTES_ALLOWED

    def _offered_by_any(self, name: str, private: bool) -> bool:
        """Whether any object may be asked for ``name``: a private name the given code
        defines, or a public name of the vocabulary."""
        return name in (self.policy.given_private if private else self.object_vocabulary)

    def _call_rule(self, node: ast.Call) -> str | Found | None:
        func = node.func
        if not isinstance(func, ast.Name) or func.id not in FORMS or func.id in self.bindings:
            return None
        if func.id in self.given:
            return None
        name, args = func.id, node.args
        if node.keywords or any(isinstance(a, ast.Starred) for a in args):
            return f"{name} with keyword or starred arguments", FORMS[name]
        parent = self.parents.get(node)
        if name == "super":
            in_attribute = isinstance(parent, ast.Attribute) and parent.value is node
            if args or not self.self_trusted or not in_attribute:
                return "super() used otherwise than super().name in a method", FORMS[name]
            return None
        if name == "type":
            is_name = isinstance(parent, ast.Attribute) and parent.attr == "__name__"
            return None if len(args) == 1 and is_name else (f"{name}(...) as a value", FORMS[name])
        if name == "hasattr":
            return None if len(args) == 2 else (f"{name} with {len(args)} arguments", FORMS[name])
        literal = args[1] if len(args) > 1 else None
        if len(args) not in (2, 3) or not (
            isinstance(literal, ast.Constant) and isinstance(literal.value, str)
        ):
            return f"{name} without a literal attribute name", FORMS[name]
        if not literal.value.isidentifier() or DUNDER.fullmatch(literal.value):
            return f"{name} of the name {literal.value!r}", FORMS[name]
        return self._receiver_rule(args[0], literal.value)

    def _assignment_rule(self, node: ast.Attribute) -> str | None:
        """An attribute may be set on self, a parameter, a local or what a call made, never on
        a module, a given class or function, or a builtin, nor on a local bound to one."""
        root: ast.AST = node.value
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        if isinstance(root, ast.Call) and not _is_super_call(root):
            return None
        if (
            not isinstance(root, ast.Name)
            or root.id not in self.bindings
            or root.id in self.modules
        ):
            owner = root.id if isinstance(root, ast.Name) else type(root).__name__
            return f"setting an attribute of {owner}, which this function does not own"
        for value in _bound_values(self.bindings[root.id], self.parents):
            chain_root = value
            while isinstance(chain_root, ast.Attribute):
                chain_root = chain_root.value
            if isinstance(chain_root, ast.Name) and chain_root.id not in self.bindings:
                return (
                    f"setting an attribute of {root.id}, bound to {chain_root.id} "
                    "(a module, a given class or a builtin)"
                )
        return None


def _string_rule(value: str | bytes, piece: bool = False) -> str | None:
    text = value if isinstance(value, str) else value.decode("latin-1")
    if DUNDER.search(text):
        return "a dunder name in a string"
    if PRIVATE_IDENTIFIER.fullmatch(text) and text != "_" and not piece:
        return "a string that names a private attribute"
    if FORMAT_FIELD_WITH_ACCESS.search(text):
        return "a format field with an attribute or an index in a string"
    return None


def _is_type_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def _is_super_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _enclosing_function(tree: ast.Module, line: int) -> tuple[ast.FunctionDef, ast.ClassDef | None]:
    """The innermost function around ``line``, and the class it is a method of (or None)."""
    found: tuple[ast.FunctionDef, ast.ClassDef | None] | None = None
    stack: list[tuple[ast.AST, ast.ClassDef | None]] = [(tree, None)]
    while stack:  # a loop, not a recursion: a deeply nested file cannot exhaust the stack
        node, owner = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    found = (child, owner)  # type: ignore[assignment]
                    stack.append((child, None))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, child))
    if found is None:
        raise RegionError(f"line {line}: a region must lie inside a function")
    return found


def region_nodes(tree: ast.Module) -> tuple[list[int], list[ast.AST]]:
    """Every node of the file that has a line, sorted by line: the lines, and the nodes (a
    region's nodes are then one slice of them, found by bisection)."""
    located = sorted(
        (
            (node.lineno, index, node)
            for index, node in enumerate(ast.walk(tree))
            if hasattr(node, "lineno")
        ),
        key=lambda entry: entry[:2],
    )
    return [line for line, _, _ in located], [node for _, _, node in located]


def _read_function(function: ast.FunctionDef) -> tuple[dict, dict, dict, set[int]]:
    """What the check needs of the region's function, in one walk: each node's parent; every
    name the function binds with the nodes that bind it (parameters, assignment, loop, with,
    comprehension and walrus targets, imports, except names, nested defs, nonlocal); the names
    bound by ``import`` (never ``from ... import``) and the module each stands for (``import
    a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``); and the ids of the nodes of
    local annotations, which Python never evaluates in a function."""
    parents: dict[ast.AST, ast.AST] = {}
    bindings: dict[str, list[ast.AST]] = {}
    modules: dict[str, str] = {}
    unevaluated: set[int] = set()
    for node in ast.walk(function):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
        for name in _names_bound_by(node, function):
            bindings.setdefault(name, []).append(node)
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                modules[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.AnnAssign):
            unevaluated |= {id(inner) for inner in ast.walk(node.annotation)}
    return parents, bindings, modules, unevaluated


def _names_bound_by(node: ast.AST, function: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(_bound_by(node, function))


def _bound_by(node: ast.AST, function: ast.FunctionDef) -> Iterator[str]:
    if isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
        yield node.id
    elif isinstance(node, ast.ExceptHandler) and node.name:
        yield node.name
    elif isinstance(node, ast.alias):
        yield node.asname or node.name.split(".")[0]
    elif isinstance(node, ast.FunctionDef) and node is not function:
        yield node.name
    elif isinstance(node, ast.Nonlocal | ast.Global):
        yield from node.names


def _bound_values(nodes: list[ast.AST], parents: dict[ast.AST, ast.AST]) -> Iterator[ast.expr]:
    """The values that plain assignments (``=``, annotated, walrus) bind to the name."""
    for node in nodes:
        parent = parents.get(node)
        if isinstance(parent, ast.Assign) and node in parent.targets:
            yield parent.value
        elif isinstance(parent, ast.AnnAssign | ast.NamedExpr) and parent.target is node:
            yield from [parent.value] if parent.value is not None else []


def names_of_class(node: ast.ClassDef, reads: bool = False) -> set[str]:
    """What a class defines: its methods, class-level names and the attributes any of its
    methods sets on ``self`` (dunders left out); with ``reads``, also those its methods read on
    ``self`` (for trusted given code only: a region must not define a name by reading it)."""
    names: set[str] = set()
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and (reads or isinstance(inner.ctx, ast.Store))
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "self"
        ):
            names.add(inner.attr)
    return {name for name in names if not DUNDER.fullmatch(name)}


def _base_names(
    tree: ast.Module, owner: ast.ClassDef | None, given_classes: dict[str, frozenset[str]]
) -> set[str]:
    """What the bases of ``owner`` define: a base defined in the same file is read there (with
    its own bases), one imported from a given module by the policy's index of given classes."""
    found: set[str] = set()
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    pending = list(owner.bases) if owner is not None else []
    seen: set[str] = set()
    while pending:
        base = pending.pop()
        if not isinstance(base, ast.Name) or base.id in seen:
            continue
        seen.add(base.id)
        if base.id in classes:
            found |= names_of_class(classes[base.id])
            pending += classes[base.id].bases
        else:
            found |= given_classes.get(base.id, frozenset())
    return found
