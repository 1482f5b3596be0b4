"""How the grader starts a part's test process: a clean interpreter, in an OS sandbox if it can.

Every test process runs ``python -S -I -B``: no ``site`` (so no ``.pth`` file, and so no
editable install of this repository, is read), no environment variables or user site, no
bytecode written; its module path is built here, explicitly: the graded tree, then the
interpreter's own site-packages. Its environment is a short fixed list, so nothing of the
grader's (tokens, ``VIRTUAL_ENV``...) reaches it; it holds the grade's seed,
``VKV_GRADE_SEED``. Results come back through a pipe (the reporter writes to the file
descriptor ``VKV_GRADE_REPORT_FD``), never through a file.

Where bubblewrap (``bwrap``, Debian's ``bubblewrap``) works, the process also runs inside it:
new user, PID, network, IPC and UTS namespaces, as uid 65534; the system libraries, the
interpreter and its packages, and the one graded tree (at ``/grade``), all read-only; a private
``/tmp`` as the only writable place; ``--die-with-parent``, and a PID namespace whose end kills
every process the tests started, so nothing outlives the run. It sees no other tree (no
reference code, no other part's isolated tree, no hidden tests unless they are its own run's),
no home directory, no network.
"""

import functools
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

SANDBOX_ROOT = "/grade"
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
SYSTEM_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/localtime",
)
PROBE_TIMEOUTS = (30.0, 60.0, 120.0)  # seconds, one try each
BOOT = (
    "import os, sys; sys.path[:0] = sys.argv[1].split(os.pathsep); del sys.argv[1]; import pytest; "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


def environment(seed: int | None = None, **extra: str) -> dict[str, str]:
    """The test process's whole environment: a fixed list, the grade's ``VKV_GRADE_SEED`` when
    ``seed`` is given, and ``extra``."""
    seeded = {} if seed is None else {"VKV_GRADE_SEED": str(seed)}
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "VKV_HYPOTHESIS_SHRINK": "0",  # pass or fail is all a grade needs
        **seeded,
        **extra,
    }


def python_command(tree: str, pytest_args: list[str], write_bytecode: bool = False) -> list[str]:
    """``python -S -I -B`` running pytest with ``tree`` and site-packages as its only path
    (``write_bytecode``: without ``-B``, for trusted code only)."""
    path = os.pathsep.join([tree, *site.getsitepackages()])
    flags = ["-S", "-I"] if write_bytecode else ["-S", "-I", "-B"]
    return [sys.executable, *flags, "-c", BOOT, path, *pytest_args]


@functools.cache
def available() -> bool:
    """Whether bubblewrap can build the sandbox here (it needs unprivileged user namespaces).

    The probe (an interpreter started in the sandbox) is tried with each limit of
    ``PROBE_TIMEOUTS`` in turn while it times out: a busy machine is slow, not sandbox-less.
    Raises ``RuntimeError`` if every try timed out.
    """
    if shutil.which("bwrap") is None:
        return False
    probe = [*_bwrap_prefix(Path("/tmp")), sys.executable, "-S", "-I", "-c", "pass"]
    for limit in PROBE_TIMEOUTS:
        try:
            done = subprocess.run(probe, capture_output=True, timeout=limit, env=environment())
        except subprocess.TimeoutExpired:
            continue
        except OSError:
            return False
        return done.returncode == 0
    raise RuntimeError(
        f"the bubblewrap probe timed out {len(PROBE_TIMEOUTS)} times (after "
        f"{', '.join(f'{t:g}' for t in PROBE_TIMEOUTS)} s): the machine is too busy to tell "
        "whether the sandbox works; grade again when it is less loaded"
    )


def why_unavailable() -> str:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian and Ubuntu: apt-get install bubblewrap)"
    return (
        "bubblewrap cannot create user namespaces here (Ubuntu 24.04 restricts them: see the "
        "README's threat model for the AppArmor profile or sysctl that allows them)"
    )


def command(tree: Path, pytest_args: list[str]) -> list[str]:
    """The sandboxed command: pytest run in ``tree``, mounted read-only at /grade."""
    return _bwrap_prefix(tree) + python_command(SANDBOX_ROOT, pytest_args)


def _bwrap_prefix(tree: Path) -> list[str]:
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-user", "--unshare-pid"]
    args += ["--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--uid", "65534", "--gid", "65534"]
    # /tmp first: a bind below it (a virtual environment in /tmp) must land on the new tmpfs
    args += ["--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    for path in SYSTEM_PATHS + SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    for prefix in _outermost({sys.base_prefix, sys.prefix, *site.getsitepackages()}):
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", str(tree), SANDBOX_ROOT]
    args += ["--chdir", SANDBOX_ROOT]
    return args


def _outermost(paths: set[str]) -> list[str]:
    """The paths that lie in none of the others."""
    return sorted(p for p in paths if not any(Path(p).is_relative_to(q) and p != q for q in paths))
