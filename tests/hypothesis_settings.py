"""Hypothesis settings shared by the graded tests: deterministic, no deadline, no database.

State machines run through ``run_counted_machine``: from a fixed seed (``derandomize`` alone
drew other runs when pytest collected other files), counting the (operation, state) pairs they
reach in the machine's ``REACHED`` and requiring the ones a test names.

A failing run must be short and about the student's code. So by default Hypothesis does not
shrink a failure (for a state machine that can take a minute) and never runs its "explain"
phase (which points at lines that the failing example merely passed through, such as
``Sequence.__len__`` reached from a ``repr``): the report is the first failing example, with
the rule that broke. Set ``VKV_HYPOTHESIS_SHRINK=1`` to get the smallest failing example
instead, at the cost of a longer run.
"""

import os
from collections import Counter

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

SHRINK = os.environ.get("VKV_HYPOTHESIS_SHRINK", "0") == "1"
MACHINE_SEED = 0
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


def run_counted_machine(
    machine: type[RuleBasedStateMachine], options: settings, required: set[tuple[str, str]]
) -> None:
    """Run the machine; then check it reached every (operation, state) pair in ``required``."""
    machine.REACHED = Counter()
    seed(MACHINE_SEED)(machine)
    run_state_machine_as_test(machine, settings=options)
    missing = required - set(machine.REACHED)
    assert not missing, f"the random runs never reached {sorted(missing)}: {machine.REACHED}"
