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
  apart. So ``import vkv`` asks for a spin long enough to bridge the gaps between a step's
  ops and short enough to end well before the next step, ``GOMP_SPINCOUNT=10000``
  (``prefer_short_spin``). Measured 2026-12-06 on 2 idle cores, the vkv side of ``vkv bench
  e2e``, fastest of 3: 1,000 rounds 2.30-2.32 s (a worker asleep at almost every region);
  10,000 1.55-1.62 s; 100,000 1.54-1.58 s; beside 4 busy loops (``benchmarks/bench_busy.py``)
  10,000 takes the time 1,000 did (7.7-8.1 s). libgomp reads the setting once, when it is
  loaded, that is when torch is first imported: ``vkv/__init__.py`` calls it before anything
  of vkv imports torch. A choice already in the environment (``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT``) is kept, so ``OMP_WAIT_POLICY=PASSIVE vkv ...`` sleeps at once; a
  program that imports torch before vkv gets libgomp's own long spin (as fast here, 1.49-1.60
  s, once ``free_cpus`` leaves our own threads out: below).
- **How many threads**: no more than the CPUs this process may use (``usable_cpus``: its CPU
  affinity, which ``taskset`` and a container's CPU set narrow, and a cgroup's CPU quota), never
  the machine's whole count. ``LLMEngine`` lowers torch's thread count to it on a CPU.
- **How many of them now**: a CPU that another program is using is no use to a second
  thread of ours. An op split over two threads ends when its slower half ends, so beside
  busy neighbours each step waits at every barrier for whichever thread the kernel had set
  aside. Before each step on a CPU the model runner asks ``free_cpus`` how many threads have
  a CPU to themselves at that instant (the kernel's count of runnable tasks, the fourth field
  of ``/proc/loadavg``, less this process's own runnable threads) and runs that many, at most
  its limit, at least one. On an idle machine that is every usable CPU; beside 4 busy loops on
  2 cores it is one, and the vkv side of ``vkv bench e2e`` took 2.9 times its idle time
  instead of 3.5. Our own threads must be left out of the count: a worker still spinning
  after the step's last region is runnable, and counted as a neighbour it made every other
  step run on one thread (libgomp's long spin: 2.10-2.14 s for the e2e side, against 1.49-1.60
  s without the miscount).
"""

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."
SPIN_COUNT = 10_000  # rounds a waiting OpenMP thread spins before it sleeps (libgomp: 300,000)
LOADAVG = Path("/proc/loadavg")  # its fourth field: "<runnable>/<all>" tasks, at this instant
_kept: dict[Path, int] = {}  # _read_kept's descriptors, by path
TASKS = Path("/proc/self/task")  # a folder per thread of this process, each with its "stat"


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
    other programs' tasks that are runnable at this instant (the kernel's count less this
    process's own runnable threads: an OpenMP worker still spinning after the last parallel
    region is ours, not a neighbour), between 1 and ``limit``; ``limit`` where the kernel does
    not say (not Linux)."""
    runnable = runnable_tasks()
    if runnable is None:
        return limit
    # the caller alone runnable: nothing to tell apart, so none of our threads is read (about
    # 7 microseconds a thread; `vkv serve`'s process has 5 to 8)
    others = runnable - (own_runnable_threads() if runnable > 1 else 1)
    return max(1, min(limit, (os.cpu_count() or 1) - others))


def own_runnable_threads() -> int:
    """This process's threads that are running or waiting for a CPU now, the caller among them
    (the state after the command name in each ``/proc/self/task/<tid>/stat``; 1, the caller,
    where that cannot be read)."""
    try:
        threads = os.listdir(TASKS)
    except OSError:
        return 1
    running = 0
    for thread in threads:
        try:
            with open(TASKS / thread / "stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # the thread ended meanwhile
            continue
        state_at = stat.rfind(b")") + 2  # a command name may hold ")" itself
        running += stat[state_at : state_at + 1] == b"R"
    return max(1, running)


def runnable_tasks() -> int | None:
    """The tasks running or waiting for a CPU on this machine now (the caller is one of them),
    or None where ``/proc/loadavg`` cannot be read."""
    try:
        return int(_read_kept(LOADAVG).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_kept(path: Path) -> bytes:
    """The start of a ``/proc`` file, read at offset 0 from a descriptor opened once: the
    kernel writes such a file anew for each read from its start, and a read of a kept
    descriptor costs about a fifth of an open, read and close (9 against 47 microseconds right
    after a parallel matrix product, when a step asks; 1 against 11 in a loop)."""
    descriptor = _kept.get(path)
    if descriptor is None:
        descriptor = _kept[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return os.pread(descriptor, 256, 0)
