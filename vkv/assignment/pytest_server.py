"""A warm process that forks one pytest run per request (``testrun.run_many`` starts it).

Importing torch, Hypothesis and pytest takes a Python process several seconds, longer than most
of the short runs ``vkv assignment check`` makes (a mutant's own part's tests, up to the first
failure). This process pays for those imports once and forks a child for each run, which starts
with them done. It never imports ``vkv``, Triton (which reads ``TRITON_INTERPRET`` when it is
imported, and the tests set that first) or a test module, so that each child imports those from
its own tree, as a fresh ``python -m pytest`` there would.

Run as a script, never imported: ``python pytest_server.py``. It says ``{"ready": true}`` once
the imports are done, then reads one JSON request a line from stdin, ``{"id", "tree", "args",
"env"}``, forks a child for it and says ``{"id", "pid"}``; when a child ends, it says ``{"id",
"exit"}`` (its exit status, or minus the signal that killed it). A child leads a session of its
own (so its pid is the group to kill, with everything it started), reads and writes nothing of
the server's pipes, moves to ``tree``, puts it first on ``sys.path``, adds ``env`` to its
environment and runs ``pytest.main(args)``. When stdin closes, the server kills what still runs
and exits.
"""

import contextlib
import json
import os
import select
import signal
import sys

PRELOADED = ("torch", "numpy", "hypothesis", "hypothesis.stateful", "pytest", "xxhash", "rich")


def main() -> None:
    for name in PRELOADED:
        with contextlib.suppress(ImportError):
            __import__(name)
    say({"ready": True})
    running: dict[int, str] = {}  # pid -> request id
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            data = os.read(stdin, 1 << 16)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request)
                running[pid] = request["id"]
                say({"id": request["id"], "pid": pid})
        reap(running, block=False)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    reap(running, block=True)


def reap(running: dict[int, str], block: bool) -> None:
    """Say the exit of every child that ended (all of them, waiting, with ``block``)."""
    while running:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        if pid in running:
            say({"id": running.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


def run_child(request: dict) -> None:
    """Run pytest as ``request`` says, in this forked child; never returns."""
    code = 3
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.chdir(request["tree"])
        os.environ.update(request["env"])
        sys.path.insert(0, request["tree"])
        sys.dont_write_bytecode = True
        import pytest

        code = int(pytest.main(request["args"]))
    finally:
        os._exit(code)


def say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    del sys.path[0]  # this script's folder (vkv/assignment) must shadow no module of a child
    main()
