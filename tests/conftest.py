"""Every test process caches the bytecode of what it imports, whatever the environment says.

Many images (Docker's Python images, CI runners, this project's own machines) set
``PYTHONDONTWRITEBYTECODE=1``, and ``uv sync`` compiles nothing by default: then every Python
process the suite starts (the pytest-xdist workers, ``vkv`` commands under test, each graded
test process of the grader's tests) compiles torch's modules from source again, about 1.5 s of
a 3.3 s ``import torch`` on a 2-core machine. Turning caching back on here, before the workers
start, lets the first import write the ``.pyc`` files and every later one read them. Graded test
processes still write nothing (the grader runs them with ``python -B``); they only read.

It also has the suite's threads sleep when they wait (``OMP_WAIT_POLICY=PASSIVE``).
"""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Under pytest-xdist each worker's OpenMP threads share the cores with the other workers': the
# busy machine on which a waiting thread should sleep at once (``vkv.threads``). Set before the
# workers start, so that they and every process they run inherit it; a choice of the caller's
# stands. Full suite on 2 cores: 577 s passive against 596 s with vkv's short spin (2026-12-06).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
