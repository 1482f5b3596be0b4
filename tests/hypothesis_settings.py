"""Hypothesis settings shared by the graded tests: deterministic, no deadline, no database.

``vkv grade`` and ``vkv assignment check`` only need to know whether a test passes, so they set
``VKV_HYPOTHESIS_SHRINK=0`` to skip shrinking a failure to its smallest example (which, for the
state machines, can take a minute). Run pytest yourself to see the shrunk example.
"""

import os

from hypothesis import HealthCheck, Phase, settings

SHRINK = os.environ.get("VKV_HYPOTHESIS_SHRINK", "1") != "0"
PHASES = tuple(phase for phase in Phase if SHRINK or phase is not Phase.shrink)


def graded_settings(**options) -> settings:
    return settings(
        derandomize=True,
        deadline=None,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        **options,
    )
