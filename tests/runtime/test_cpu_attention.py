"""The CPU backend's in-place decode attention (``paged_decode.c``) against the reference.

Shuffled block tables with padding, block sizes 1, 5 and 16, heads that group by 1, 2 and 4,
head sizes that are not a multiple of 8 or of 32 (the vector loops' tails), one and two
threads, and a batch of the engine's shape; the fallbacks (no compiler, ``VKV_CPU_KERNEL=0``, a
cache the loop does not handle) give the reference's results; greedy completions of vkv-tiny
are the same with the loop and without it. The compiled loop is required when
``VKV_REQUIRE_CPU_KERNEL=1`` (``.ci/run`` sets it, after installing a C compiler if there is
none); elsewhere the tests of the loop skip without one. The CPU backend is the CPU's: these
tests run there on every machine.
"""

import os
import subprocess
import sys

import pytest
import torch
from test_kernels import build_cache, dense_decode

from vkv.engine.llm_engine import LLMEngine
from vkv.kernels import cpu_attention, reference
from vkv.sampling_params import SamplingParams

HAVE_KERNEL = cpu_attention.kernel_path() is not None
needs_kernel = pytest.mark.skipif(
    not HAVE_KERNEL and os.environ.get("VKV_REQUIRE_CPU_KERNEL") != "1",
    reason="no C compiler to build paged_decode.c (VKV_REQUIRE_CPU_KERNEL=1 fails instead)",
)


def decode_both(lengths, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    k_cache, v_cache, tables, dense = build_cache(
        lengths, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed
    )
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    context = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, tables, context, scale)
    expected = dense_decode(query, dense, num_heads // num_kv_heads, scale)  # float64
    return (
        cpu_attention.paged_decode_attention(*args),
        reference.paged_decode_attention(*args),
        expected,
    )


@needs_kernel
def test_the_loop_is_built_when_required():
    assert HAVE_KERNEL, "no compiled paged_decode.c: is a C compiler (cc) installed?"


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [32, 20, 44, 40])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_the_loop_matches_the_reference_and_dense_attention(
    block_size, num_heads, num_kv_heads, head_dim, threads
):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, theirs, dense = decode_both(
            [1, 37, 20, 16, 5], num_heads, num_kv_heads, head_dim, block_size
        )
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=0)
    torch.testing.assert_close(ours.double(), dense, atol=2e-5, rtol=0)


@needs_kernel
def test_the_loop_matches_the_reference_on_an_engine_sized_batch():
    lengths = torch.randint(1, 400, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, theirs, _ = decode_both(lengths, 8, 4, 32, 16, seed=3)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=0)


def test_a_cache_the_loop_does_not_handle_falls_back_to_the_reference():
    k_cache, v_cache, tables, _ = build_cache([9, 3], 2, 32, 4, torch.float16, "cpu")
    query = torch.randn(2, 4, 32).half()
    args = (query, k_cache, v_cache, tables, torch.tensor([9, 3], dtype=torch.int32), 0.2)
    assert torch.equal(
        cpu_attention.paged_decode_attention(*args), reference.paged_decode_attention(*args)
    )


@pytest.mark.parametrize(
    "env", [{"VKV_CPU_KERNEL": "0"}, {"CC": "/nonexistent/cc"}], ids=["disabled", "no-compiler"]
)
def test_without_the_loop_decode_attention_is_the_reference(tmp_path, env):
    program = (
        "import torch\n"
        "from vkv.kernels import cpu_attention, reference\n"
        "assert cpu_attention.kernel_path() is None, cpu_attention.kernel_path()\n"
        "cache = torch.randn(3, 4, 2, 8)\n"
        "args = (torch.randn(2, 4, 8), cache, cache, torch.tensor([[0, 2], [1, -1]],"
        " dtype=torch.int32), torch.tensor([7, 2], dtype=torch.int32), 0.3)\n"
        "assert torch.equal(cpu_attention.paged_decode_attention(*args),"
        " reference.paged_decode_attention(*args))\n"
    )
    environment = dict(os.environ, VKV_CACHE_DIR=str(tmp_path), **env)
    done = subprocess.run(
        [sys.executable, "-c", program], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not any(tmp_path.iterdir()), "nothing is built without the loop"


@needs_kernel
def test_greedy_completions_are_the_same_with_and_without_the_loop(monkeypatch):
    prompts = ["The block table maps", "def allocate(self, seq):", "Paged attention"]
    params = SamplingParams(temperature=0.0, max_tokens=40)

    def complete() -> list[list[int]]:
        engine = LLMEngine(None, device="cpu", block_size=4, num_gpu_blocks=64)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.sequence(i).completion_token_ids for i in ids]

    with_loop = complete()
    monkeypatch.setattr(cpu_attention, "_kernel", lambda: None)
    assert complete() == with_loop


@needs_kernel
@pytest.mark.parametrize(
    ("table", "context"),
    [([[0, -1]], 7), ([[0, 9]], 7), ([[0, 1]], 9)],
    ids=["padding-inside-the-context", "a-block-past-the-cache", "context-past-the-table"],
)
def test_a_table_that_does_not_cover_its_context_is_refused(table, context):
    cache = torch.randn(3, 4, 2, 8)
    with pytest.raises(ValueError, match="block table"):
        cpu_attention.paged_decode_attention(
            torch.randn(1, 4, 8),
            cache,
            cache,
            torch.tensor(table, dtype=torch.int32),
            torch.tensor([context], dtype=torch.int32),
            0.3,
        )


@needs_kernel
def test_a_cache_directory_that_cannot_be_written_builds_in_a_private_one(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be: mkdir fails
    program = (
        "from vkv.kernels import cpu_attention\n"
        "path = cpu_attention.kernel_path()\n"
        "assert path is not None and 'vkv-' in str(path.parent), path\n"
    )
    environment = dict(os.environ, VKV_CACHE_DIR=str(blocked / "cache"))
    done = subprocess.run(
        [sys.executable, "-c", program], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
