"""``vkv assignment gradescope OUT.zip``: the autograder package an instructor uploads.

Gradescope's contract, from its autograder specification
(https://gradescope-autograders.readthedocs.io/en/latest/specs/, the same text as
``docs/specs.md`` of github.com/gradescope/autograder_samples):

- the package is a zip with at least ``setup.sh`` ("a setup (Bash) script that installs all your
  dependencies"; the images are Ubuntu, so apt works) and ``run_autograder`` ("an executable
  script, in any language (with appropriate #! line)") at its root, not in a folder;
- the zip is extracted to ``/autograder/source``, and ``run_autograder`` is copied to
  ``/autograder/run_autograder``; it runs with ``/autograder`` as its working directory;
- the student's submission is in ``/autograder/submission``; ``run_autograder`` must write
  ``/autograder/results/results.json``; what it prints goes to ``/autograder/results/stdout``,
  shown to instructors only unless ``stdout_visibility`` says otherwise;
- ``results.json`` holds ``score`` (overrides the tests' total), ``execution_time`` (seconds),
  ``output``, ``visibility``, ``stdout_visibility``, ``extra_data`` and ``tests``, each test
  with ``score``, ``max_score``, ``status`` (``passed`` or ``failed``), ``name``, ``number``,
  ``output``, ``tags``, ``visibility`` (``hidden``, ``after_due_date``, ``after_published``,
  ``visible``). ``vkv grade --format gradescope`` (``report.as_gradescope``) writes it; this
  module only packages the grader.

The package holds, under ``/autograder/source``:

- ``edition/``: the student edition, made by ``release.release`` (tests, grader, ``uv.lock``
  pinning every dependency, stubs in every region): the *trusted* tree the submission's editable
  files are overlaid on. It is never the submission's, so a submission cannot bring its own
  tests, grader, configuration or lock file;
- ``hidden/``: this repository's hidden tests (``tests/hidden``), which the edition leaves out;
- ``setup.sh``: run once when Gradescope builds the image (as root, as Gradescope runs its
  autograders: saligrama.io/blog/gradescope-autograder-security): installs bubblewrap (the
  grader's sandbox), Debian's ``prometheus`` (``promtool``, which grades parts 5.4-5.8), a C
  compiler (the CPU decode kernel), uv (pinned, ``UV_VERSION``, by its standalone installer into
  ``/usr/local/bin``), then ``uv sync --frozen --compile-bytecode`` in ``edition/`` (Python and
  the locked packages, compiled once: every graded process runs ``python -B`` and only reads);
- ``run_autograder``: grades ``/autograder/submission`` with the edition's ``vkv grade``
  (``--trusted`` the edition, ``--hidden`` the hidden tests, ``--format gradescope``, output
  ``/autograder/results/results.json``), offline and with the ``uv`` found on ``PATH``. It asks
  the grader's own probe (``sandbox.available``) whether bubblewrap works: if so it grades with
  ``--require-sandbox``; if not (a container that forbids user namespaces) with
  ``--unsafe-no-sandbox``, and the results' ``output`` then begins by saying that the run is a
  progress check, not a grade. A probe that fails otherwise (it timed out three times) stops the
  run, with no results.

With ``parts``, the package grades only those parts (e.g. one Gradescope assignment per phase).
"""

import tempfile
import zipfile
from pathlib import Path

from vkv.assignment.parts import Assignment
from vkv.assignment.release import release, source_files
from vkv.assignment.results import HIDDEN_DIR

UV_VERSION = "0.13.9"  # the uv setup.sh installs: the one that ran test_gradescope.py here
EDITION = "edition"
HIDDEN = "hidden"
ZIP_DATE = (2000, 1, 1, 0, 0, 0)  # every entry's timestamp: the same tree gives the same zip

SETUP_SH = f"""\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu).
# Written by `vkv assignment gradescope`; see vkv/assignment/gradescope.py.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# bubblewrap: the grader's sandbox; prometheus: promtool, which grades parts 5.4-5.8; gcc: the
# CPU decode kernel; curl: the uv installer.
apt-get install -y -qq --no-install-recommends \\
    bubblewrap prometheus gcc libc6-dev curl ca-certificates
curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | env UV_UNMANAGED_INSTALL=/usr/local/bin sh
cd /autograder/source/{EDITION}
# compiled once here: every graded test process runs python -B, which reads .pyc but writes none
/usr/local/bin/uv sync --frozen --compile-bytecode
"""

RUN_AUTOGRADER = f"""\
#!/usr/bin/env bash
# Gradescope runs this for every submission, as root, in /autograder. It grades
# /autograder/submission against the student edition in /autograder/source/{EDITION} and the
# hidden tests, and writes /autograder/results/results.json. Written by
# `vkv assignment gradescope`; see vkv/assignment/gradescope.py.
set -euo pipefail
cd /autograder/source/{EDITION}
mkdir -p /autograder/results
probe=0
uv run --frozen --offline python -c \\
    'import sys; from vkv.assignment import sandbox; sys.exit(0 if sandbox.available() else 3)' \\
    || probe=$?
case "$probe" in
    0) sandbox=--require-sandbox ;;
    3) echo "bubblewrap cannot run here: the results will say this is a progress check"
       sandbox=--unsafe-no-sandbox ;;
    *) echo "the sandbox probe failed (exit status $probe)"; exit "$probe" ;;
esac
exec uv run --frozen --offline vkv grade /autograder/submission --trusted . \\
    --hidden ../{HIDDEN} --format gradescope "$sandbox" \\
    --output /autograder/results/results.json{{parts}}
"""


def package(root: Path, out: Path, parts: set[str] | None = None) -> list[str]:
    """Write the Gradescope autograder zip of the reference tree ``root`` to the new file ``out``.

    ``parts`` (ids, as ``Assignment.expand`` gives them) limits the grade to those parts; by
    default every part is graded. Returns the names in the zip, ``setup.sh`` and
    ``run_autograder`` first. Raises ``FileExistsError`` if ``out`` exists, ``KeyError`` naming
    any part that does not exist.
    """
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new file")
    assignment = Assignment.load(root)
    unknown = set() if parts is None else parts - set(assignment.part_ids)
    if unknown:
        raise KeyError(f"no such parts: {', '.join(sorted(unknown))}")
    chosen = "" if parts is None else " --parts " + ",".join(sorted(parts))
    hidden_prefix = HIDDEN_DIR.as_posix() + "/"
    hidden = [path for path in source_files(root) if path.startswith(hidden_prefix)]
    with tempfile.TemporaryDirectory(prefix="vkv-gradescope-") as scratch:
        edition = Path(scratch) / EDITION
        release(root, edition, commit=False)
        entries = [
            ("setup.sh", SETUP_SH.encode(), 0o755),
            ("run_autograder", RUN_AUTOGRADER.format(parts=chosen).encode(), 0o755),
        ]
        for path in sorted(p for p in edition.rglob("*") if p.is_file()):
            entries.append((f"{EDITION}/{path.relative_to(edition).as_posix()}", path, None))
        for path in hidden:
            entries.append((f"{HIDDEN}/{path.removeprefix(hidden_prefix)}", root / path, None))
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data, mode in entries:
                if isinstance(data, Path):
                    mode = 0o755 if data.stat().st_mode & 0o111 else 0o644
                    data = data.read_bytes()
                info = zipfile.ZipInfo(name, ZIP_DATE)
                info.external_attr = (0o100000 | mode) << 16  # a regular file and its mode
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, data)
    return [name for name, _, _ in entries]
