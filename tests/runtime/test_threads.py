"""The engine's CPU threads (vkv/threads.py): asleep when they wait, no more than its CPUs.

The slowdown itself (beside busy processes) is measured by ``benchmarks/bench_busy.py``, never
asserted as a time here.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from vkv import threads

PROBE = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU, as taskset -c would
import vkv, torch
from vkv.engine.llm_engine import LLMEngine
torch.set_num_threads(4)  # as many as a machine's cores, more than this process may use
LLMEngine(num_gpu_blocks=8, max_model_len=64, device="cpu")
waits = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
print(json.dumps({**waits, "threads": torch.get_num_threads()}))
"""


def probe(**environment: str) -> dict:
    """What a fresh process pinned to one CPU sees after ``import vkv`` and an engine."""
    chosen = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_importing_vkv_asks_for_a_short_spin_and_an_engine_uses_only_its_cpus():
    seen = probe()
    assert seen["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT), "set before torch is imported"
    assert seen["OMP_WAIT_POLICY"] is None, "libgomp's policy, with a shorter spin"
    assert seen["threads"] == 1, f"pinned to one CPU, the engine ran {seen['threads']} threads"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
@pytest.mark.parametrize(
    ("chosen", "kept"),
    [
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
        ({"GOMP_SPINCOUNT": "50"}, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "50"}),
    ],
    ids=["passive", "active", "spin count"],
)
def test_how_the_user_chose_threads_to_wait_is_kept(chosen, kept):
    """A spin count would override a chosen policy's (libgomp reads both): none is added."""
    seen = probe(**chosen)
    assert {name: seen[name] for name in kept} == kept


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [("150000 100000\n", 2), ("100000 100000\n", 1), ("max 100000\n", math.inf), (None, math.inf)],
    ids=["1.5 CPUs", "1 CPU", "no quota", "no cgroup file"],
)
def test_a_cgroup_cpu_quota_caps_the_cpus(tmp_path, monkeypatch, cpu_max, quota):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", path)
    assert threads._quota_cpus() == quota
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads.usable_cpus() == min(affinity, quota)


@pytest.mark.parametrize(
    ("runnable", "cpus", "free"),
    [(1, 2, 2), (2, 2, 1), (5, 2, 1), (3, 8, 4), (40, 64, 4), (None, 2, 4)],
    ids=["idle", "one neighbour", "four neighbours", "big machine", "busy big machine", "unknown"],
)
def test_free_cpus_leaves_the_cpus_other_tasks_run_on(monkeypatch, runnable, cpus, free):
    monkeypatch.setattr(threads, "runnable_tasks", lambda: runnable)
    monkeypatch.setattr(threads, "own_runnable_threads", lambda: 1)  # the caller alone
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert threads.free_cpus(4) == free


@pytest.mark.parametrize(("runnable", "own", "free"), [(2, 2, 2), (3, 2, 1), (6, 2, 1)])
def test_free_cpus_does_not_count_this_processs_own_threads_as_neighbours(
    monkeypatch, runnable, own, free
):
    """A worker of ours still spinning after the last parallel region is runnable too: counted
    as a neighbour, a step on 2 threads would leave the next one on 1, and so on, turn about."""
    monkeypatch.setattr(threads, "runnable_tasks", lambda: runnable)
    monkeypatch.setattr(threads, "own_runnable_threads", lambda: own)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads.free_cpus(2) == free


def test_free_cpus_reads_no_thread_of_its_own_when_the_caller_alone_runs(monkeypatch):
    def unread():
        raise AssertionError("the caller alone is runnable: nothing of ours to subtract")

    monkeypatch.setattr(threads, "runnable_tasks", lambda: 1)
    monkeypatch.setattr(threads, "own_runnable_threads", unread)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads.free_cpus(2) == 2


def test_own_runnable_threads_reads_each_threads_state(tmp_path, monkeypatch):
    stats = {
        "100": "100 (python) R 1 100 100 0 -1",
        "101": "101 (python) S 1 100 100 0 -1",
        "102": "102 (a) S (b) R 1 100 100 0 -1",  # ")" in the command name: the last one ends it
        "103": "103 (pt_main) D 1 100 100 0 -1",
    }
    for tid, stat in stats.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "stat").write_text(stat)
    (tmp_path / "104").mkdir()  # a thread that ended between the listing and the read
    monkeypatch.setattr(threads, "TASKS", tmp_path)
    assert threads.own_runnable_threads() == 2
    monkeypatch.setattr(threads, "TASKS", tmp_path / "missing")
    assert threads.own_runnable_threads() == 1, "the caller, where the kernel does not say"


@pytest.mark.parametrize(
    ("text", "runnable"),
    [("0.52 0.61 0.70 3/412 9981\n", 3), ("garbage\n", None), (None, None)],
    ids=["linux", "unreadable", "no file"],
)
def test_runnable_tasks_reads_the_kernels_instant_count(tmp_path, monkeypatch, text, runnable):
    path = tmp_path / "loadavg"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(threads, "LOADAVG", path)
    assert threads.runnable_tasks() == runnable


def test_each_cpu_step_runs_the_threads_that_have_a_cpu_now(monkeypatch):
    """Busy neighbours: one thread; idle again: back to the engine's limit."""
    import torch

    from vkv.engine.llm_engine import LLMEngine
    from vkv.sampling_params import SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = LLMEngine(num_gpu_blocks=8, max_model_len=64, device="cpu")
        seen = []
        forward = type(engine.runner.model).forward

        def counting(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return forward(*args, **kwargs)

        monkeypatch.setattr(type(engine.runner.model), "forward", counting)
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        for runnable in (5, 1):
            monkeypatch.setattr(threads, "runnable_tasks", lambda runnable=runnable: runnable)
            engine.add_request("ab", SamplingParams(max_tokens=1))
            engine.step()
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)
