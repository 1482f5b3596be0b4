"""The engine's CPU threads: as many as the CPUs this process may use, briefly spinning, then
asleep, when they wait.

On a CPU, PyTorch's ops and the C decode-attention loop share one OpenMP thread pool (the
libgomp that PyPI's torch loads). Two settings decide how the engine fares on a machine that
other programs share (a lab machine, a laptop with a browser open, a CI runner):

- **How a thread waits** at the end of a parallel region for the others. By default libgomp
  spins for a long while (300,000 rounds) before it sleeps. On idle cores that saves a
  wake-up; beside busy processes it burns the time slice that the late thread needs, and every
  step pays it at each of its hundreds of barriers: beside 4 busy loops on 2 cores, ``vkv demo
  --no-live`` took 7.6 times its idle time and the vkv side of ``vkv bench e2e`` 16 times
  (``benchmarks/bench_busy.py``), where a CPU-bound program should take about 2.5 to 3 times.
  Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) cured that, but then every parallel region
  wakes its threads through the kernel, and a step runs hundreds of regions microseconds
  apart: on an idle machine the e2e side took 1.15 times as long as with a short spin, and
  beside the busy loops longer too. So ``import vkv`` asks for a short spin,
  ``GOMP_SPINCOUNT=1000`` (``prefer_short_spin``; measured 2026-12-06, e2e side idle 3.08 s
  against 3.54 s passive and 3.40 s with the long default, whose spinning threads also make
  ``free_cpus`` below count the engine's own threads as others'). libgomp reads it once, when
  it is loaded, that is when torch is first imported: ``vkv/__init__.py`` calls it before
  anything of vkv imports torch. A choice already in the environment (``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT``) is kept, so ``OMP_WAIT_POLICY=PASSIVE vkv ...`` sleeps at once.
- **How many threads**: no more than the CPUs this process may use (``usable_cpus``: its CPU
  affinity, which ``taskset`` and a container's CPU set narrow, and a cgroup's CPU quota), never
  the machine's whole count. ``LLMEngine`` lowers torch's thread count to it on a CPU.
- **How many of them now**: a CPU that another program is using is no use to a second
  thread of ours. An op split over two threads ends when its slower half ends, so beside
  busy neighbours each step waits at every barrier for whichever thread the kernel had set
  aside. Before each step on a CPU the model runner asks ``free_cpus`` how many threads have
  a CPU to themselves at that instant (the kernel's count of runnable tasks, the fourth field
  of ``/proc/loadavg``) and runs that many, at most its limit, at least one. On an idle
  machine that is every usable CPU; beside 4 busy loops on 2 cores it is one, and the vkv side
  of ``vkv bench e2e`` took 2.9 times its idle time instead of 3.5.
"""

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."
SPIN_COUNT = 1000  # rounds a waiting OpenMP thread spins before it sleeps (libgomp: 300,000)
LOADAVG = Path("/proc/loadavg")  # its fourth field: "<runnable>/<all>" tasks, at this instant


def prefer_short_spin() -> None:
    """Ask OpenMP for a short spin before a waiting thread sleeps, unless the environment
    already chose how threads wait (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``).

    Takes effect only before torch is first imported in this process (and in the processes it
    starts, which inherit the environment)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup's CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, _quota_cpus()))


def _quota_cpus() -> int | float:
    """The CPU quota of this process's cgroup, rounded up (infinite where there is none)."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return math.ceil(int(quota) / int(period))
    except (OSError, ValueError):  # no cgroup v2 file, or "max": no quota
        return math.inf


def free_cpus(limit: int) -> int:
    """How many of ``limit`` threads have a CPU to themselves now: the machine's CPUs less the
    tasks other than the caller that are runnable at this instant, between 1 and ``limit``;
    ``limit`` where the kernel does not say (not Linux)."""
    others = runnable_tasks()
    if others is None:
        return limit
    return max(1, min(limit, (os.cpu_count() or 1) - (others - 1)))


def runnable_tasks() -> int | None:
    """The tasks running or waiting for a CPU on this machine now (the caller is one of them),
    or None where ``/proc/loadavg`` cannot be read."""
    try:
        return int(LOADAVG.read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
