"""Tensor parallelism over torch.distributed (gloo, on this machine's CPU): two processes give
the greedy tokens of one, through preemption by swap and by recompute, chunked prefill, prefix
caching and an int8 cache; a worker that dies ends the run with one error, no process left.

The reference is the same engine with ``tensor_parallel_size=1``, whose output the other
runtime tests hold to transformers'. Each two-process engine starts a worker (a spawned
Python that imports torch: a few seconds). Every engine, command and worker here runs on the
CPU, also on a machine with a GPU (one GPU cannot hold two ranks): ``on_the_cpu``.
"""

import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_checkpoints import tiny_hf_model

from vkv.cli import main
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.parallel import WorkerError
from vkv.net import free_port
from vkv.sampling_params import SamplingParams

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self, item):\n",
    "for i in range(10):\n",
    "    return sorted(items, key=lambda x: x[1])\n",
    "with open(path) as f:\n",
]
SHARED = "# a module docstring that every request of the prefix-caching case begins with\n" * 2


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """``VKV_DEVICE=cpu`` for the engines, the commands and the processes they start."""
    monkeypatch.setenv("VKV_DEVICE", "cpu")


def greedy(tensor_parallel_size: int, prompts=PROMPTS, max_tokens=40, model=None, **options):
    """Every prompt's greedy tokens, and the engine's totals (preemptions, swaps, hits)."""
    engine = LLMEngine(model, tensor_parallel_size=tensor_parallel_size, **options)
    with engine:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        swapped = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] += output.new_token_ids
            swapped += engine.stats["blocks_swapped_out"]
        totals = {
            "preemptions": engine.scheduler.num_preemptions,
            "blocks_swapped_out": swapped,
            "prefix_cache_hits": engine.stats["prefix_cache_hits"],
        }
    return [tokens[i] for i in ids], totals


CASES = {
    "plain": {},
    "swap": {"num_gpu_blocks": 12, "num_cpu_blocks": 64, "preemption_mode": "swap"},
    "recompute": {"num_gpu_blocks": 12, "preemption_mode": "recompute"},
    "chunked prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
    "int8": {"kv_cache_dtype": "int8"},
    "int8 keys per channel": {  # the residual's slots come back every step, moves or not
        "kv_cache_dtype": "int8",
        "key_granularity": "per_channel",
        "block_size": 4,
        "max_num_seqs": 2,
    },
    "int8 keys per channel, swap": {
        "kv_cache_dtype": "int8",
        "key_granularity": "per_channel",
        "num_gpu_blocks": 14,
        "num_cpu_blocks": 64,
        "preemption_mode": "swap",
    },
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_two_processes_generate_the_greedy_tokens_of_one(case):
    options = {"num_gpu_blocks": 64, "max_num_seqs": 8, **CASES[case]}
    one, one_totals = greedy(1, **options)
    two, two_totals = greedy(2, **options)
    assert two == one
    assert two_totals == one_totals, "the same schedule: rank 0 decides, every rank applies"
    if "swap" in case:
        assert one_totals["blocks_swapped_out"] > 0, "the case must swap"
    if case == "recompute":
        assert one_totals["preemptions"] > 0, "the case must preempt"


def test_prefix_caching_hits_the_same_blocks_with_two_processes():
    prompts = [SHARED + prompt for prompt in PROMPTS]
    options = {"num_gpu_blocks": 64, "max_num_seqs": 2, "enable_prefix_caching": True}
    one, one_totals = greedy(1, prompts, **options)
    two, two_totals = greedy(2, prompts, **options)
    assert two == one and two_totals == one_totals
    assert one_totals["prefix_cache_hits"] > 0


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_a_random_checkpoint_with_grouped_query_attention_splits_its_heads(architecture, tmp_path):
    tiny_hf_model(architecture).save_pretrained(tmp_path)  # 4 heads, 2 KV heads, vocab 96
    prompts = [[3, 14, 15, 92, 65, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]]
    options = {"model": tmp_path, "num_gpu_blocks": 32, "block_size": 4}
    assert greedy(2, prompts, 24, **options)[0] == greedy(1, prompts, 24, **options)[0]


@pytest.mark.parametrize(
    ("size", "said"),
    [(3, "does not divide the model's 8 attention heads"), (0, "must be a positive integer")],
)
def test_a_split_that_does_not_divide_is_refused_before_any_process_starts(size, said):
    with pytest.raises(ValueError, match=said):
        LLMEngine(tensor_parallel_size=size)
    assert multiprocessing.active_children() == []


def test_the_cli_refuses_a_split_that_does_not_divide_in_one_line(capsys):
    assert main(["generate", "x", "--tensor-parallel-size", "3", "--max-tokens", "1"]) == 2
    error = capsys.readouterr().err
    assert "does not divide the model's 8 attention heads" in error and error.count("\n") == 1


def test_vkv_generate_runs_over_two_processes(capsys):
    prompt = "def fibonacci(n):\n"
    arguments = ["generate", prompt, "--temperature", "0", "--max-tokens", "24"]
    assert main([*arguments, "--tensor-parallel-size", "2"]) == 0
    two = capsys.readouterr().out
    assert main(arguments) == 0
    assert two == capsys.readouterr().out
    assert multiprocessing.active_children() == [], "the worker stopped with the command"


def test_torchrun_starts_every_rank_and_the_others_serve_rank_0(tmp_path):
    """``torchrun --no-python vkv ...`` runs the command on every rank: rank 0 runs it, the
    others become its workers (the rendezvous is torchrun's env://)."""
    arguments = ["generate", "def fibonacci(n):\n", "--temperature", "0", "--max-tokens", "24"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--no-python"]
    # the installed script; where the tree is only importable (a GPU machine's python3 with
    # PYTHONPATH, scripts/gpu_check.sh), the module
    vkv = [shutil.which("vkv")] if shutil.which("vkv") else [sys.executable, "-m", "vkv.cli"]
    command = [*launcher, *vkv, *arguments, "--tensor-parallel-size", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    alone = subprocess.run([*vkv, *arguments], capture_output=True, text=True, timeout=300)
    assert done.stdout == alone.stdout and "def fibonacci" in done.stdout
    assert "tensor parallel over 2 processes" in done.stderr


def test_a_step_that_fails_on_rank_0_stops_the_workers_instead_of_hanging(monkeypatch):
    """With the workers inside the same forward, rank 0 cannot retry a sequence alone (as one
    process does): the run ends with one error."""
    engine = LLMEngine(tensor_parallel_size=2, num_gpu_blocks=64)
    with engine:
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
        engine.step()
        mlp = engine.model.model.layers[1].mlp
        monkeypatch.setattr(mlp, "forward", lambda x: (_ for _ in ()).throw(ValueError("boom")))
        with pytest.raises(WorkerError, match=r"a step failed on rank 0 .* boom"):
            engine.step()
        [worker] = engine.parallel.processes
    assert not worker.is_alive() and multiprocessing.active_children() == []


def test_a_worker_that_dies_before_the_group_forms_fails_the_start_at_once(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "not a number")  # the spawned worker's first step fails
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 .* died with exit code 1"):
        LLMEngine(tensor_parallel_size=2, num_gpu_blocks=16)
    assert time.monotonic() - started < 60
    assert multiprocessing.active_children() == []


def test_a_second_engine_with_tensor_parallelism_is_refused_while_the_first_runs():
    with LLMEngine(tensor_parallel_size=2, num_gpu_blocks=16) as first:
        with pytest.raises(ValueError, match="close that engine first"):
            LLMEngine(tensor_parallel_size=2, num_gpu_blocks=16)
        first.add_request("def f(x):\n", SamplingParams(temperature=0, max_tokens=4))
        while first.has_unfinished_requests():
            first.step()  # the first engine's group is untouched
    assert multiprocessing.active_children() == []


def test_an_engine_dropped_without_close_stops_its_worker_and_leaves_its_group():
    engine = LLMEngine(tensor_parallel_size=2, num_gpu_blocks=16)
    [worker] = engine.parallel.processes
    del engine
    gc.collect()
    assert not worker.is_alive() and multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized(), "the group is left, a new engine can form one"
    tokens, _ = greedy(2, PROMPTS[:2], max_tokens=4, num_gpu_blocks=16)
    assert tokens == greedy(1, PROMPTS[:2], max_tokens=4, num_gpu_blocks=16)[0]


def test_a_killed_worker_ends_the_run_with_one_error_and_no_process_left():
    engine = LLMEngine(tensor_parallel_size=2, num_gpu_blocks=64)
    with engine:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for prompt in PROMPTS:
            engine.add_request(prompt, params)
        engine.step()
        [worker] = engine.parallel.processes
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank 1 .* died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 30
    assert not worker.is_alive() and multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized(), "the group is left, a new engine can form one"
