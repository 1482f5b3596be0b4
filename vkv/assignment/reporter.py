"""The grader's pytest plugin: one JSON line per test phase, and a guard against tampering.

``vkv grade`` runs pytest with ``-p vkv.assignment.reporter`` (plugin autoloading off, the
grader's own configuration, no conftest) and reads the results from the file named by
``VKV_GRADE_REPORT``, never from pytest's exit code or anything the tests print.

The guard: when pytest is configured, before any test module (and so any submitted code) is
imported, it records every function of pytest's runner, reports and collection machinery, of
the ``pytest`` namespace and of ``builtins``, with its code object, and the registered plugins
(when the session starts, just before collection).
After collection and after every test it compares: a graded module that patched pytest (to pass
every test, say) is caught, and every result of the run is marked as tampered, which the grader
scores as failed. The last line, ``finished``, tells the grader the session was not cut short.

This stops the tricks a submission can play from inside the tests' process that the grader's
tests list; it is not a sandbox: code that runs with the grader's rights can, with enough effort,
forge anything that process writes. Run untrusted code in a container for an authoritative grade.
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


class Reporter:
    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config = config
        self.out = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held for the session)
        self.baseline: dict[str, object] = {}
        self.tampered: str | None = None

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def verify(self) -> None:
        if self.tampered is not None:
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
        self.verify()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        if self.tampered is None and "runtest" in vars(item):
            self.tampered = f"{item.nodeid}: runtest replaced on the item"

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
    path = os.environ.pop("VKV_GRADE_REPORT", None)
    if path is not None:
        config.pluginmanager.register(Reporter(config, path), "vkv-grade-reporter")


_ = builtins  # guarded by name in GUARDED_MODULES; imported so that it is in sys.modules
