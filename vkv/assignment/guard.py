"""The grader's guard: the identity of the code a test process must not change, kept live.

``reporter.py`` arms a ``Guard`` before any submitted code is imported (pytest's runner, reports
and collection machinery, Hypothesis, the reporter itself, the modules a part may import) and
asks it after every test what changed: a function, class or descriptor that is no longer the
same object, a function whose code was swapped, a new callable entry, a module replaced in
``sys.modules``. Data entries may change (pytest caches state in module globals).
"""

import operator
import sys
import types
from collections.abc import Callable, Mapping


class Guard:
    """The identity of every function, class and descriptor of some namespaces, kept live.

    ``add_module`` records a module's namespace and those of its classes; ``changed`` names the
    first entry that is no longer the same object (or whose function has other code), is gone,
    or is new and callable, and None if there is none. Data entries may change. A check runs
    at C speed (``itemgetter``, ``map``) and names the entry only when it found a change.
    """

    def __init__(self) -> None:
        self.modules: dict[str, object] = {}
        self.namespaces: list[Namespace] = []

    def add_module(self, name: str) -> None:
        module = sys.modules.get(name)
        self.modules[name] = module
        if module is None:
            return
        self.add_namespace(name, vars(module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, type):
                self.add_namespace(f"{name}.{attr}", vars(value))

    def add_namespace(self, prefix: str, namespace: Mapping) -> None:
        self.namespaces.append(Namespace(prefix, namespace))

    def changed(self) -> str | None:
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                return f"sys.modules[{name}]"
        for namespace in self.namespaces:
            found = namespace.changed()
            if found is not None:
                return found
        return None


class Namespace:
    """One guarded namespace (a module's or a class's ``__dict__``, read live)."""

    def __init__(self, prefix: str, namespace: Mapping) -> None:
        self.prefix = prefix
        self.namespace = namespace
        self.keys = frozenset(namespace)
        entries = {key: value for key, value in list(namespace.items()) if _behaves(value)}
        self.names = tuple(entries)
        self.values = tuple(entries.values())
        self.get = _getter(self.names)
        functions = {key: _function(value) for key, value in entries.items()}
        self.functions = tuple((k, f) for k, f in functions.items() if f is not None)
        self.codes = tuple(f.__code__ for _, f in self.functions)

    def changed(self) -> str | None:
        try:
            same = all(map(operator.is_, self.get(self.namespace), self.values))
        except KeyError:
            same = False
        if not same:
            for key, value in zip(self.names, self.values, strict=True):
                if self.namespace.get(key, _MISSING) is not value:
                    return f"{self.prefix}.{key}"
        code = map(operator.attrgetter("__code__"), (f for _, f in self.functions))
        if not all(map(operator.is_, code, self.codes)):
            for (key, function), code in zip(self.functions, self.codes, strict=True):
                if function.__code__ is not code:
                    return f"{self.prefix}.{key}"
        if self.namespace.keys() != self.keys:
            for key in self.namespace.keys() - self.keys:
                if _behaves(self.namespace.get(key)):
                    return f"{self.prefix}.{key}"
            self.keys = frozenset(self.namespace)  # data entries only: they may change
        return None


_MISSING = object()


def _getter(names: tuple[str, ...]) -> Callable[[Mapping], tuple]:
    """A function from a namespace to the tuple of its values at ``names``."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda namespace: tuple(namespace[name] for name in names)


def _function(value: object) -> types.FunctionType | None:
    """The Python function behind a function, static or class method (its code can be
    swapped), else None."""
    function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
    return function if isinstance(function, types.FunctionType) else None


def _behaves(value: object) -> bool:
    """Whether the value is code (a function, a class, a descriptor), not data pytest caches."""
    return callable(value) or isinstance(value, property | staticmethod | classmethod)
