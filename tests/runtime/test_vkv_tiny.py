"""The built-in vkv-tiny checkpoint, and the commands that run on it: ``vkv generate``,
``vkv demo`` and ``vkv bench e2e``. What is compared with transformers' tokens runs in float32,
each backend where it runs (``devices.py``); seeded samples whose text is checked run on the CPU
(``llm``); the rest on the engine's default device."""

import io
import json
import re

import pytest
import torch
from devices import BACKENDS, EXACT_DTYPE
from rich.console import Console
from tiny_checkpoints import greedy_by_recompute
from transformers import AutoModelForCausalLM

from vkv import LLM, SamplingParams, demo
from vkv.bench import Workload, run_e2e, run_transformers, run_vkv
from vkv.cli import main
from vkv.demo import run_demo
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.outputs import INCOMPLETE_CHARACTER
from vkv.models.loader import DEFAULT_MODEL

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def llm():
    """On the CPU everywhere: its tests check what seeded samples say, and a GPU's generator
    draws other numbers from the same seeds."""
    return LLM(device="cpu")


def test_vkv_tiny_is_a_small_byte_level_checkpoint_with_its_training_report():
    weights = DEFAULT_MODEL / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    report = json.loads((DEFAULT_MODEL / "training.json").read_text())
    assert report["held_out_bits_per_byte"] < 2.0, report
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 257


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_default_model_generates_what_transformers_generates(backend, device):
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    engine = LLM(backend=backend, device=device, dtype=EXACT_DTYPE, kv_cache_bytes=4 << 20)
    prompts = [PROMPT, "import os\n"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for prompt, output in zip(prompts, engine.generate(prompts, params, False), strict=True):
        assert output["token_ids"] == greedy_by_recompute(hf, list(prompt.encode()), 24, eos=256)
        assert output["text"] == bytes(output["token_ids"]).decode("utf-8", "replace")


def test_vkv_tiny_writes_python(llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, seed=s) for s in range(4)]
    text = "".join(output["text"] for output in llm.generate([PROMPT] * 4, params, False))
    assert all(word in text for word in ("self", "return", "if ", "    ")), text
    assert sum(c.isprintable() or c in "\n" for c in text) >= 0.98 * len(text)


def test_streaming_never_emits_half_a_character(llm, monkeypatch):
    engine = llm.engine
    script = iter("é→!".encode())  # two- and three-byte characters, one byte a step
    monkeypatch.setattr(
        engine.runner, "execute", lambda scheduled, more=None: [next(script) for _ in scheduled]
    )
    engine.add_request("#", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [output.new_text for output in engine.step()]
    assert pieces == ["", "é", "", "", "→", "!"]
    assert INCOMPLETE_CHARACTER not in "".join(pieces)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_demo_preempts_and_finishes_every_request(mode):
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    summary = run_demo(
        console,
        requests=8,
        gpu_blocks=10,
        cpu_blocks=16,
        preemption_mode=mode,
        max_tokens=64,
        steps_per_second=None,  # every step drawn, as fast as the engine goes
    )
    assert summary.preemptions > 0
    assert sum(summary.finish_reasons.values()) == 8
    assert set(summary.finish_reasons) <= {"stop", "length"}
    assert 8 * 16 <= summary.generated_tokens <= 8 * 64
    swapped = (summary.blocks_swapped_out, summary.blocks_swapped_in)
    if mode == "swap":
        assert swapped[0] == swapped[1] > 0
    else:
        assert swapped == (0, 0)
    shown = console.file.getvalue()
    assert "GPU blocks" in shown and "vkv demo: summary" in shown


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_the_demo_preempts_in_every_kv_format_and_says_what_its_blocks_cost(kv_cache_dtype):
    console = Console(file=io.StringIO(), width=200)
    summary = run_demo(
        console, requests=8, gpu_blocks=10, max_tokens=64, live=False, kv_cache_dtype=kv_cache_dtype
    )
    assert summary.preemptions > 0, "the pool is gpu_blocks blocks in every format: too small"
    shown = console.file.getvalue()
    assert "10 GPU blocks" in shown
    assert re.search(r"GPU KV bytes +│ [\d.]+ MiB, \d\.\d\dx less than 16-bit", shown), shown


def test_the_live_demo_draws_every_step_at_its_pace_and_fast_never_waits(monkeypatch):
    waits = []
    monkeypatch.setattr(demo.time, "sleep", waits.append)
    for pace in (4.0, None):
        waits.clear()
        console = Console(file=io.StringIO(), force_terminal=True, width=120)
        summary = run_demo(console, requests=2, gpu_blocks=8, max_tokens=4, steps_per_second=pace)
        if pace is None:
            assert waits == [], "--fast never waits"
        else:
            assert len(waits) == summary.steps, "every step is drawn, then waits for the pace"
            assert all(0 <= wait <= 1 / pace for wait in waits)


def test_demo_and_generate_commands(llm, capsys):
    assert main(["demo", "--requests", "3", "--max-tokens", "8", "--no-live"]) == 0
    assert "vkv demo: summary" in capsys.readouterr().out
    assert main(["demo", "--requests", "0"]) == 2
    assert "at least one request" in capsys.readouterr().err, "errors go to stderr"
    assert main(["demo", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["generate", PROMPT, "--max-tokens", "8", "--device", "cpu"]) == 0
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0)
    [expected] = llm.generate([PROMPT], params, False)
    assert PROMPT + expected["text"] in capsys.readouterr().out


def test_bench_e2e_compares_like_with_like():
    result = run_e2e(
        num_requests=6,
        prompt_lens=(4, 40),
        output_lens=(2, 12),
        max_num_seqs=4,
        hf_batch=3,
        repeat=1,
    )
    assert result.identical_completions == 6
    assert 0.0 <= result.overhead_share < 1.0
    assert result.speedup_min <= result.speedup_median <= result.speedup_max


def test_bench_e2e_gives_transformers_every_thread_whatever_vkvs_last_step_ran(monkeypatch):
    """vkv's steps run only the threads that find a CPU free (one, here); each transformers run
    gets the engine's whole limit (two), and the result reports the limit."""
    from vkv import bench
    from vkv.engine import llm_engine, model_runner

    monkeypatch.setattr(llm_engine, "usable_cpus", lambda: 2)
    monkeypatch.setattr(model_runner, "free_cpus", lambda limit: 1)
    seen = []

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_transformers(*args, **kwargs)

    monkeypatch.setattr(bench, "run_transformers", counted)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = run_e2e(num_requests=2, prompt_lens=(4, 8), output_lens=(2, 4), repeat=2)
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 2], "the warm-up and both rounds"
    assert result.threads == 2 and result.identical_completions == 2


def test_both_sides_of_the_benchmark_generate_past_eos(device):
    engine = LLMEngine(max_num_seqs=4, device=device, dtype=EXACT_DTYPE)
    workload = Workload.mixed(lambda text: list(text.encode()), 4, (8, 24), (20, 30))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = 32  # a space: it would end every row early
    _, hf_out = run_transformers(hf, workload, 2, pad_token_id=256)
    ours = run_vkv(engine, workload).completions
    assert [len(c) for c in hf_out] == [len(c) for c in ours] == workload.output_lens
    assert hf_out == ours and any(32 in c for c in ours)


def test_engine_rejects_a_kv_budget_without_a_block():
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(kv_cache_bytes=1024)


def test_demo_on_a_stubbed_edition_names_the_part(monkeypatch, capsys):
    from vkv.engine.block_manager import BlockManager

    def stub(self, seq):
        raise NotImplementedError("part 1.3: BlockManager.can_allocate")

    monkeypatch.setattr(BlockManager, "can_allocate", stub)
    assert main(["demo", "--requests", "2", "--no-live"]) == 2
    assert "error: part 1.3: BlockManager.can_allocate" in capsys.readouterr().err
