"""How the graded cost tests measure: CPU time of the measured code alone, compared as a ratio.

A cost rule ("allocate is O(1) whatever the pool's size", "a step is O(batch)") is pinned by a
ratio of two runs of the student's code, never by an absolute time. Two things make a wall-clock
ratio fail correct code on a busy machine, and this module removes both:

- the process is descheduled while another one runs: the time measured is this thread's CPU
  time (``time.thread_time``), which does not advance while the thread waits for a core;
- the garbage collector runs in the middle of one run and not the other, with a cost that grows
  with every live object: it is off while a run is timed.

``fastest_ratio`` interleaves the runs of the two sizes (small, large, small, large, ...) so
that a slow patch of the machine touches both, and compares the fastest of each.
"""

import gc
import math
from collections.abc import Callable
from time import thread_time


def cpu_seconds(setup: Callable[[], Callable[[], object]]) -> float:
    """CPU seconds of one run: ``setup()`` builds the state (untimed) and returns the call."""
    measured = setup()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        start = thread_time()
        measured()
        return thread_time() - start
    finally:
        if enabled:
            gc.enable()


def fastest_ratio(
    small: Callable[[], Callable[[], object]],
    large: Callable[[], Callable[[], object]],
    repeats: int,
    hopeless: float = 100.0,
) -> tuple[float, float]:
    """The fastest CPU seconds of ``small`` and of ``large`` over ``repeats`` interleaved runs.

    A ``large`` run ``hopeless`` times slower than the fastest ``small`` one ends the
    measurement: no machine's noise makes CPU time differ that much, and a wrong
    implementation's large runs can take minutes."""
    best_small = best_large = math.inf
    for _ in range(repeats):
        best_small = min(best_small, cpu_seconds(small))
        best_large = min(best_large, cpu_seconds(large))
        if best_large > hopeless * best_small:
            break
    return best_small, best_large
