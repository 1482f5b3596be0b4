"""The grader's pytest plugin: one JSON line per test phase, and a guard against tampering.

``vkv grade`` runs pytest with ``-p vkv.assignment.reporter`` (plugin autoloading off, the
grader's own configuration, no conftest) and reads the results from the pipe whose file
descriptor is ``VKV_GRADE_REPORT_FD``, never from pytest's exit code or anything the tests
print.

The guard: when pytest is configured, before any test module (and so any submitted code) is
imported, it records every function of pytest's runner, reports and collection machinery, of
the ``pytest`` namespace and of ``builtins``, with its code object, and the registered plugins
(when the session starts, just before collection).
After collection and after every test it compares: a graded module that patched pytest (to pass
every test, say) is caught, and every result of the run is marked as tampered, which the grader
scores as failed. Each test item's function (``obj``, ``_obj``, ``function``) and its code are
recorded after collection and checked before and after the test runs, and no profile or trace
function may be installed. The last line, ``finished``, tells the grader the session was not cut
short.

This is the last of three layers. The static policy (``policy.py``) keeps submitted code from
naming anything it would need to tamper with, and the sandbox (``sandbox.py``) bounds what an
escape could reach; the guard catches tampering that got past both from inside the process. It
cannot stop code running in this process from forging what this process writes.
"""

import builtins
import contextlib
import importlib
import json
import os
import sys

import pytest

GUARDED_MODULES = (
    "vkv.assignment.reporter",
    "json",
    "json.encoder",
    "hypothesis.core",
    "hypothesis.stateful",
    "hypothesis.internal.conjecture.engine",
    "_pytest.runner",
    "_pytest.python",
    "_pytest.reports",
    "_pytest.main",
    "_pytest.outcomes",
    "_pytest.nodes",
    "_pytest.fixtures",
    "_pytest.skipping",
    "pluggy._callers",
    "pluggy._hooks",
    "pluggy._manager",
    "pytest",
    "builtins",
)


def _snapshot(config: pytest.Config) -> dict[str, object]:
    """Every guarded function, class and descriptor (with its code), and the plugin names."""
    state: dict[str, object] = {}
    for name in GUARDED_MODULES:
        module = sys.modules.get(name)
        state[f"sys.modules[{name}]"] = module
        for attr, value in vars(module).items() if module is not None else ():
            if _behaves(value):
                state[f"{name}.{attr}"] = (value, getattr(value, "__code__", None))
            if isinstance(value, type):
                for member, inner in vars(value).items():
                    if _behaves(inner):
                        key = f"{name}.{attr}.{member}"
                        state[key] = (inner, getattr(inner, "__code__", None))
    state["plugins"] = tuple(name for name, _ in config.pluginmanager.list_name_plugin())
    for name, caller in vars(config.hook).items():
        state[f"config.hook.{name}"] = caller
    return state


def _behaves(value: object) -> bool:
    """Whether the value is code (a function, a class, a descriptor), not data pytest caches."""
    return callable(value) or isinstance(value, property | staticmethod | classmethod)


def _test_function(item: pytest.Item) -> tuple[object, ...]:
    """What runs for a test item: its function objects and their code."""
    found = tuple(vars(item).get(name) for name in ("obj", "_obj", "function"))
    return found + tuple(getattr(f, "__code__", None) for f in found)


class Reporter:
    def __init__(self, config: pytest.Config, fd: int) -> None:
        self.config = config
        self.out = os.fdopen(fd, "w", encoding="utf-8")
        self.baseline: dict[str, object] = {}
        self.functions: dict[str, tuple[object, ...]] = {}
        self.tampered: str | None = None

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def verify(self) -> None:
        if self.tampered is not None:
            return
        if sys.getprofile() is not None or sys.gettrace() is not None:
            self.tampered = "a profile or trace function was installed"
            return
        now = _snapshot(self.config)
        for key, value in self.baseline.items():
            if not _same(now.get(key), value):
                self.tampered = key
                return
        extra = set(now) - set(self.baseline)
        if extra:
            self.tampered = sorted(extra)[0]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.baseline = _snapshot(self.config)  # before collection imports any test module

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.functions = {item.nodeid: _test_function(item) for item in session.items}
        self.verify()

    def check_item(self, item: pytest.Item) -> None:
        if self.tampered is not None:
            return
        if "runtest" in vars(item):
            self.tampered = f"{item.nodeid}: runtest replaced on the item"
        elif not _same(_test_function(item), self.functions.get(item.nodeid)):
            self.tampered = f"{item.nodeid}: the test function replaced on the item"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self.check_item(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.check_item(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.verify()
        record = {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "message": str(report.longrepr)[-4000:] if report.failed else "",
        }
        if self.tampered is not None:
            record |= {"outcome": "failed", "message": f"pytest was tampered with: {self.tampered}"}
        self.write(record)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.verify()
        self.write({"event": "finished", "tampered": self.tampered})
        self.out.close()


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


def pytest_configure(config: pytest.Config) -> None:
    for name in GUARDED_MODULES:  # loaded now, so that the baseline holds them
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    fd = os.environ.pop("VKV_GRADE_REPORT_FD", None)
    if fd is not None:
        config.pluginmanager.register(Reporter(config, int(fd)), "vkv-grade-reporter")


_ = builtins  # guarded by name in GUARDED_MODULES; imported so that it is in sys.modules
