"""Rules checked offline with ``promtool test rules`` (Debian's prometheus package), given.

``promtool test rules`` loads a rules file, feeds it input series written in promtool's
expanding notation (``'0+60x20'`` is 0, 60, ..., 1200, one value an ``interval``; ``_`` is a
missing sample, ``stale`` ends a series), evaluates the rules every ``evaluation_interval``, and
compares what an expression returns at a time (``promql_expr_test``) or which alerts fire
(``alert_rule_test``) with what is expected. It is deterministic: no clock, no scrape. The
phase's tests (parts 5.4 to 5.8) use it through ``promtool_test``.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

RECORD_KEYS = {"record", "expr", "labels"}
ALERT_KEYS = {"alert", "expr", "for", "labels", "annotations"}


def promtool() -> str | None:
    """The path of ``promtool``, or None when it is not installed."""
    return shutil.which("promtool") or (
        "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None
    )


def shape_problem(rule: object) -> str | None:
    """Why ``rule`` is not a rule as a rules file holds it (see ``rules.py``), or None."""
    if not isinstance(rule, dict):
        return f"a rule is a dict, got {type(rule).__name__}: {rule!r}"
    kind = "record" if "record" in rule else "alert" if "alert" in rule else None
    if kind is None:
        return f"a rule has a 'record' or an 'alert' name, got the keys {sorted(rule)}"
    allowed = RECORD_KEYS if kind == "record" else ALERT_KEYS
    if not set(rule) <= allowed or "expr" not in rule:
        return f"a {kind} rule has the keys {sorted(allowed)} ('expr' required), got {sorted(rule)}"
    for key, value in rule.items():
        if key in ("labels", "annotations"):
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                return f"{rule[kind]!r}: {key} map strings to strings, got {value!r}"
        elif not isinstance(value, str):
            return f"{rule[kind]!r}: {key} is a string, got {value!r}"
    return None


def promtool_test(rules: list[dict], tests: list[dict], folder: Path, interval="15s") -> str | None:
    """Run ``promtool test rules`` on ``rules`` (one group) with ``tests`` (promtool's test
    groups: ``input_series``, ``promql_expr_test``, ``alert_rule_test``), evaluated every
    ``interval``, in ``folder``. Returns None when every check passed, else what promtool said
    (a rule that does not parse, or each expected result against the one it got)."""
    binary = promtool()
    if binary is None:
        return "promtool is not installed (Debian: apt-get install prometheus)"
    problems = [p for p in map(shape_problem, rules) if p]
    if problems:
        return "\n".join(problems)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rules.json").write_text(json.dumps({"groups": [{"name": "vkv", "rules": rules}]}))
    test = {
        "rule_files": ["rules.json"],
        "evaluation_interval": interval,
        "tests": [{"interval": interval, **group} for group in tests],
    }
    (folder / "test.json").write_text(json.dumps(test, indent=1))
    run = subprocess.run(
        [binary, "test", "rules", "test.json"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode == 0:
        return None
    return (run.stdout + run.stderr).replace("Unit Testing:  test.json", "").strip()
