"""Hypothesis settings shared by the graded tests: deterministic, no deadline, no database.

A failing run must be short and about the student's code. So by default Hypothesis does not
shrink a failure (for a state machine that can take a minute) and never runs its "explain"
phase (which points at lines that the failing example merely passed through, such as
``Sequence.__len__`` reached from a ``repr``): the report is the first failing example, with
the rule that broke. Set ``VKV_HYPOTHESIS_SHRINK=1`` to get the smallest failing example
instead, at the cost of a longer run.
"""

import os

from hypothesis import HealthCheck, Phase, settings

SHRINK = os.environ.get("VKV_HYPOTHESIS_SHRINK", "0") == "1"
PHASES = tuple(
    phase for phase in Phase if phase is not Phase.explain and (SHRINK or phase is not Phase.shrink)
)


def graded_settings(**options) -> settings:
    return settings(
        derandomize=True,
        deadline=None,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        **options,
    )
