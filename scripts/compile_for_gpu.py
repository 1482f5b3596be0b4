"""Compile every Triton kernel of the GPU path for an H200 (sm_90), on a machine without one.

The Triton interpreter runs the kernels on a CPU, and it is lenient where the compiler is not
(a scalar mixed with a block, a layout ``tl.interleave`` or ``tl.dot`` cannot take, a dtype a
GPU instruction refuses): a kernel that passes every interpreted test can still fail to
compile on the first GPU it meets. So this script calls the real wrappers (the stores, decode
and prefill attention, the layer ops) on CPU tensors in each cache format, with each launch
intercepted: instead of running, the launch is compiled ahead of time for ``TARGET`` with the
arguments it was given (their dtypes, the constexprs, the launch options), to PTX and cubin
with the ``ptxas`` that Triton's wheel carries. Nothing runs and no GPU is needed.

    python scripts/compile_for_gpu.py [--anatomy] [--load]

It prints a line per launch and a summary; exit status 1 if any launch failed to compile
(``tests/runtime/test_kernels_compile_for_a_gpu.py`` runs it). With ``--load``, only the
launches that inline part 3.8's ``load_dequantized``: the attention kernel, decode and prefill,
in each quantized format, on caches left empty (no store, no plan: those are other parts), which
part 3.8's graded test runs on a student's load. With ``--anatomy``, each line
also says what the GPU would run (from the cubin, by the ``cuobjdump`` of Triton's wheel):
registers a thread, bytes spilled to local memory, instructions, how many of them the longest
loop holds (the attention kernel's tile loop, which each of a program's warps issues once for
``BLOCK_N`` cached tokens: so many warp instructions a cached token), and the global loads by
width (``LDG``: into registers, ``LDGSTS``: an asynchronous copy into shared memory, as a
pipelined tile loop does; ``.128``: 16 bytes a lane, the widest; ``.U8``: one byte). No
timing: a GPU measures (``benchmarks/bench_decode_kernel.py``); this shows why a kernel is slow
before one is at hand. Bytes are not the only cost: an H200's SM receives about 16 bytes a
cycle at the copy bandwidth and issues at most 4 warp instructions a cycle (the first GPU run's
INT8 decode issued about 1.5 a cycle), so a token of one KV head (K and V: 512 bytes in 16
bits, 264 in INT8, 136 in INT4) leaves about 126, 65 and 34 warp instructions at the very best
before the tile loop, not the memory, sets the time (phase3.md's cost model).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.kernels import triton_attention, triton_layer_ops

TARGET = GPUTarget("cuda", 90, 32)  # an H100 or H200: compute capability 9.0, 32-lane warps
BACKEND = make_backend(TARGET)
SHOWN = ("DECODE", "BITS", "KEYS_PER_CHANNEL", "FOLD_KEYS", "FOLD_SCALES", "BLOCK_N", "ADD", "NORM")
SHOW_ANATOMY = False
ONLY_LOAD = False  # --load: the attention kernel's launches alone
failures: list[str] = []
compiled: list[str] = []


def compile_launch(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
    """Stands in for ``JITFunction.run``: compile this launch for ``TARGET``, specialized as a
    launch there would be (Triton's own binder: argument types, constexprs, and the alignment
    of pointers and integers that lets loads be vectorized)."""
    if ONLY_LOAD and kernel.fn.__name__ != "_attention_kernel":
        return
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        BACKEND, kwargs, bound, specialization, options
    )
    named = {path[0]: value for path, value in constexprs.items() if len(path) == 1}
    values = {kernel.params[index].name: value for index, value in named.items()}
    shown = ", ".join(f"{key}={values[key]}" for key in SHOWN if key in values)
    label = f"{kernel.fn.__name__}({shown})"
    started = time.perf_counter()
    try:
        source = ASTSource(kernel, signature, constexprs, attrs)
        compiled_kernel = triton.compile(source, target=TARGET, options=options.__dict__)
    except Exception:
        failures.append(label)
        print(f"FAILED {label}\n{traceback.format_exc(limit=2)}", flush=True)
        return
    compiled.append(label)
    details = ""
    if SHOW_ANATOMY:
        cubin = compiled_kernel.asm["cubin"]
        details = f": {anatomy(cubin, options.num_warps, values.get('BLOCK_N'))}"
    print(f"compiled {label} in {time.perf_counter() - started:.1f} s{details}", flush=True)


def anatomy(cubin: bytes, num_warps: int, tile_tokens: int | None) -> str:
    """Registers, spilled bytes, instructions, the longest loop's (with ``tile_tokens``, the
    tokens a tile loop's pass reads: the warp instructions a cached token costs) and global
    loads by width of one kernel."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [tool, "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tool, "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
    registers, stack = re.search(r"REG:(\d+)", usage)[1], re.search(r"STACK:(\d+)", usage)[1]
    instructions = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)
    loads = collections.Counter(re.findall(r"\b(LDG|LDGSTS)\.E(?:\.BYPASS)?(?:\.(\w+))?", sass))
    widths = ", ".join(
        f"{count} {kind}.{width or '32'}" for (kind, width), count in sorted(loads.items())
    )
    loop = longest_loop(instructions)
    per_token = f", {num_warps} warps x {loop} / {tile_tokens} tokens" if tile_tokens else ""
    per_token += f" = {num_warps * loop / tile_tokens:.1f} a cached token" if tile_tokens else ""
    return (
        f"{registers} registers, {stack} B spilled, {len(instructions)} instructions"
        f" ({loop} in the longest loop{per_token}); {widths}"
    )


def longest_loop(instructions: list[tuple[str, str]]) -> int:
    """How many instructions the longest loop of a kernel's SASS holds (a branch back to an
    earlier address closes a loop): the tile loop's, which a warp issues once a tile."""
    addresses = [int(address, 16) for address, _ in instructions]
    longest = 0
    for address, (_, text) in zip(addresses, instructions, strict=True):
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) < address:
            start = int(branch[1], 16)
            longest = max(longest, sum(start <= at <= address for at in addresses))
    return longest


def caches(kv_cache_dtype: str, keys: str, block_size: int) -> CacheEngine:
    """A CPU cache engine in one format, its layers laid out as on a GPU."""
    shape = CacheShape(1, block_size, 2, 128, torch.float16, kv_cache_dtype, keys)
    return CacheEngine(shape, 8, 0, torch.device("cpu"), residual_slots=2)


def attention(engine: CacheEngine, fold_keys: bool, fold_scales: bool) -> None:
    """A store (but with ``--load``), a decode (both stages) and a prefill over ``engine``'s
    layer 0 (keys per channel: ``fold_keys``, folded into the query or read per lane; a
    quantized cache: ``fold_scales``, its per-token scales applied to scores and weights)."""
    if not ONLY_LOAD:
        slots = list(range(4))
        engine.plan_step(slots)  # keys per channel: the step's plan, which the layer carries
        key = torch.randn(4, 2, 128, dtype=torch.float16)
        triton_attention.store_kvcache(key, key.clone(), *engine.layer(0), torch.tensor(slots))
    k_cache, v_cache = engine.layer(0)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lengths = torch.tensor([20, 30], dtype=torch.int32)
    query = torch.randn(2, 8, 128, dtype=torch.float16)
    triton_attention.paged_decode_attention(
        query, k_cache, v_cache, tables, lengths, 0.1, fold_keys=fold_keys, fold_scales=fold_scales
    )
    cu_seqlens = torch.tensor([0, 1, 2], dtype=torch.int32)
    triton_attention.paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        cu_seqlens,
        tables,
        lengths,
        0.1,
        fold_keys=fold_keys,
        fold_scales=fold_scales,
    )


def layer_ops() -> None:
    """Each fused layer op, on the first layer (no residual yet) and a later one, with and
    without Qwen3's q/k norm."""
    x = torch.randn(4, 256, dtype=torch.float16)
    weight = torch.ones(256, dtype=torch.float16)
    triton_layer_ops.add_rms_norm(x, None, weight, 1e-6)
    triton_layer_ops.add_rms_norm(x, x.clone(), weight, 1e-6)
    qkv = torch.randn(4, (8 + 2 * 2) * 128, dtype=torch.float16)
    q, k = qkv[:, : 8 * 128].view(4, 8, 128), qkv[:, 8 * 128 : 10 * 128].view(4, 2, 128)
    positions = torch.arange(4)
    table = torch.randn(16, 128, dtype=torch.float16)
    norm = torch.ones(128, dtype=torch.float16)
    for weights in ((norm, norm), (None, None)):
        triton_layer_ops.qk_norm_rotary(q, k, positions, table, table, *weights, 1e-6)
    triton_layer_ops.silu_and_mul(torch.randn(4, 2 * 768, dtype=torch.float16))


def main() -> int:
    global SHOW_ANATOMY, ONLY_LOAD
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anatomy", action="store_true", help="registers, spills, loads")
    parser.add_argument("--load", action="store_true", help="part 3.8's load: attention only")
    args = parser.parse_args()
    SHOW_ANATOMY, ONLY_LOAD = args.anatomy, args.load
    JITFunction.run = compile_launch
    formats = [] if ONLY_LOAD else [("auto", "per_token", False, False)]
    for bits in (8, 4):
        formats.append((f"int{bits}", "per_token", False, False))
        formats.append((f"int{bits}", "per_channel", True, False))  # a tile inside a block
        formats.append((f"int{bits}", "per_channel", False, False))  # tiles across blocks
        if not ONLY_LOAD:  # per token the load is not called; per channel, as above
            formats.append((f"int{bits}", "per_token", False, True))
            formats.append((f"int{bits}", "per_channel", False, True))
    skipped = 0
    for kv_cache_dtype, keys, fold_keys, fold_scales in formats:
        try:
            attention(caches(kv_cache_dtype, keys, 16), fold_keys, fold_scales)
        except NotImplementedError as stub:  # a student's tree: a part not written yet
            skipped += 1
            folded = ", keys folded" if fold_keys else ""
            folded += ", scales folded" if fold_scales else ""
            print(f"skipped {kv_cache_dtype} {keys}{folded}: {stub}", flush=True)
    if not ONLY_LOAD:
        layer_ops()
    print(
        f"{len(compiled)} launches compiled for sm_90, {len(failures)} failed"
        + (f", {skipped} cache formats skipped (a part's stub)" if skipped else ""),
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
