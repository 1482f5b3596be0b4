"""The seed of the hidden tests: one per grade, so that a table of answers cannot pass them.

Not a test module (it holds no test): the helper that ``test_phase<P>_hidden.py`` share. It is
named ``test_*.py`` because ``vkv assignment check`` copies only ``tests/hidden/test_*.py`` into
the trees it checks; the grader runs only ``test_phase<P>_*.py`` files and copies the whole
folder, this file with it.

The grader draws a seed per grade and hands it to every test process as the environment
variable ``VKV_GRADE_SEED`` (a decimal integer). Run by hand without it, the tests draw a seed
of their own (``secrets``), one per process. Every hidden test is decorated with ``@seeded``: it
receives ``rng``, a ``random.Random`` seeded with the grade's seed and the test's name (each
test its own stream, the same for the same seed), and any failure it raises carries a note with
the seed, so that it can be replayed::

    VKV_GRADE_SEED=1234 uv run pytest tests/hidden -k part3
"""

import functools
import inspect
import os
import random
import secrets
from collections.abc import Callable

ENV = "VKV_GRADE_SEED"


def _read_seed() -> int:
    text = os.environ.get(ENV)
    if text is None:
        return secrets.randbelow(2**32)
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"{ENV} must be a decimal integer, got {text!r}") from None


SEED = _read_seed()
REPLAY = f"replay this draw: {ENV}={SEED}"


def rng_for(name: str, seed: int = SEED) -> random.Random:
    """The random stream of test ``name`` under ``seed`` (this process's, by default)."""
    return random.Random(f"{seed}:{name}")


def seeded(test: Callable) -> Callable:
    """Give ``test`` its ``rng`` (first parameter) and put the seed on every failure it raises.

    The other parameters (pytest fixtures such as ``monkeypatch``) pass through.
    """
    signature = inspect.signature(test)
    rest = list(signature.parameters.values())[1:]

    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(rng_for(test.__name__), *args, **kwargs)
        except BaseException as failure:
            failure.add_note(REPLAY)
            raise

    run.__signature__ = signature.replace(parameters=rest)
    return run
