"""``vkv assignment check`` must catch an unsound assignment (instructor tooling)."""

import subprocess
import textwrap
from pathlib import Path

from rich.console import Console

from vkv.assignment.check import check

MUTANTS_CHECK = "every mutant fails a graded test of its own part"

MODULE = '''
def double(x):
    """Return 2 * x."""
    ### BEGIN SOLUTION part1.1
    return 2 * x
    ### END SOLUTION


def triple(x):
    """Return 3 * x."""
    ### BEGIN SOLUTION part1.2
    return 3 * x
    ### END SOLUTION
'''

TESTS = """
from vkv.engine.toy import double, triple


def test_part1_double():
    assert double(2) == 4


def test_part2_triple():
    assert triple(2) == 6
"""

MANIFEST = """
[assignment]
editable = ["vkv/engine/toy.py"]
release_exclude = []

[[part]]
id = "1.1"
title = "double"
points = 1

[[part]]
id = "1.2"
title = "triple"
points = 1
"""


def make_toy(root: Path, extra_tests: str = "") -> Path:
    files = {
        "assignment/parts.toml": MANIFEST,
        "vkv/__init__.py": "",
        "vkv/engine/__init__.py": "",
        "vkv/engine/toy.py": MODULE,
        "tests/test_phase1.py": TESTS + textwrap.dedent(extra_tests),
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def failed_checks(root: Path) -> dict[str, str]:
    findings = check(root, Console(quiet=True))
    return {f.check: f.detail for f in findings if not f.ok}


def test_a_sound_toy_assignment_passes(tmp_path):
    assert failed_checks(make_toy(tmp_path)) == {}


def test_a_test_that_passes_on_the_stub_is_caught(tmp_path):
    root = make_toy(tmp_path, "\n\ndef test_part2_always():\n    assert True\n")
    failed = failed_checks(root)
    assert "test_part2_always (passed on the stubs)" in " ".join(failed.values())
    assert "stubbing part 1.2 fails its tests and only its dependents'" in failed


def test_an_undeclared_dependency_is_caught(tmp_path):
    root = make_toy(
        tmp_path, "\n\ndef test_part1_uses_triple():\n    assert double(triple(1)) == 6\n"
    )
    failed = failed_checks(root)
    assert "stubbing part 1.2 fails its tests and only its dependents'" in failed
    assert (
        "does not depend on 1.2"
        in failed["stubbing part 1.2 fails its tests and only its dependents'"]
    )


def test_a_test_outside_any_part_is_caught(tmp_path):
    root = make_toy(tmp_path, "\n\ndef test_part7_orphan():\n    assert double(1) == 2\n")
    assert "every graded test belongs to a part" in failed_checks(root)


def test_a_mutant_the_tests_miss_is_reported(tmp_path):
    root = make_toy(tmp_path)
    (root / "assignment/mutants.toml").write_text(
        '[[mutant]]\npart = "1.1"\nfile = "vkv/engine/toy.py"\nwhy = "caught"\n'
        'find = "return 2 * x"\nreplace = "return 2 - x"\n\n'
        '[[mutant]]\npart = "1.2"\nfile = "vkv/engine/toy.py"\nwhy = "equivalent"\n'
        'find = "return 3 * x"\nreplace = "return x + x + x"\n'
    )
    manifest = root / "assignment/parts.toml"
    manifest.write_text(
        manifest.read_text().replace(
            "release_exclude = []", 'release_exclude = ["assignment/mutants.toml"]'
        )
    )
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    failed = failed_checks(root)
    assert list(failed) == [MUTANTS_CHECK]
    assert "equivalent" in failed[MUTANTS_CHECK]
    assert "caught" not in failed[MUTANTS_CHECK]


def with_mutants(root: Path, mutants: str, depends: bool = False) -> Path:
    (root / "assignment/mutants.toml").write_text(mutants)
    manifest = root / "assignment/parts.toml"
    text = manifest.read_text().replace(
        "release_exclude = []", 'release_exclude = ["assignment/mutants.toml"]'
    )
    if depends:
        text += 'depends_on = ["1.1"]\n'
    manifest.write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def test_a_mutant_caught_only_by_another_parts_tests_is_reported(tmp_path):
    root = make_toy(
        tmp_path, "\n\ndef test_part2_six_times():\n    assert triple(double(7)) == 42\n"
    )
    with_mutants(
        root,
        '[[mutant]]\npart = "1.1"\nfile = "vkv/engine/toy.py"\nwhy = "wrong at 7"\n'
        'find = "return 2 * x"\nreplace = "return 2 * x if x != 7 else 0"\n',
        depends=True,
    )
    failed = failed_checks(root)
    assert list(failed) == [MUTANTS_CHECK]
    assert (
        "mutant 0 of part 1.1 (wrong at 7): no test of part 1.1 fails" in failed[MUTANTS_CHECK]
    ), "a mutant of part 1.1 that only part 1.2's tests catch is not caught by its own part"


def test_a_mutant_outside_its_parts_region_is_reported(tmp_path):
    with_mutants(
        make_toy(tmp_path),
        '[[mutant]]\npart = "1.1"\nfile = "vkv/engine/toy.py"\nwhy = "wrong part"\n'
        'find = "return 3 * x"\nreplace = "return 3 + x"\n',
    )
    failed = failed_checks(tmp_path)
    assert "names part 1.1 but its find text lies in part 1.2's region" in failed[MUTANTS_CHECK]


def test_a_mutant_that_hangs_counts_as_caught(tmp_path, monkeypatch):
    import vkv.assignment.check as check_module

    monkeypatch.setattr(check_module, "RUN_TIMEOUT_S", 10.0)
    root = make_toy(tmp_path)
    (root / "assignment/mutants.toml").write_text(
        '[[mutant]]\npart = "1.2"\nfile = "vkv/engine/toy.py"\nwhy = "hangs"\n'
        'find = "return 3 * x"\nreplace = "while True:\\n        pass"\n'
    )
    manifest = root / "assignment/parts.toml"
    manifest.write_text(
        manifest.read_text().replace(
            "release_exclude = []", 'release_exclude = ["assignment/mutants.toml"]'
        )
    )
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    assert failed_checks(root) == {}
