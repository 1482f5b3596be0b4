"""Compile every Triton kernel of the GPU path for an H200 (sm_90), on a machine without one.

The Triton interpreter runs the kernels on a CPU, and it is lenient where the compiler is not
(a scalar mixed with a block, a layout ``tl.interleave`` or ``tl.dot`` cannot take, a dtype a
GPU instruction refuses): a kernel that passes every interpreted test can still fail to
compile on the first GPU it meets. So this script calls the real wrappers (the stores, decode
and prefill attention, the layer ops) on CPU tensors in each cache format, with each launch
intercepted: instead of running, the launch is compiled ahead of time for ``TARGET`` with the
arguments it was given (their dtypes, the constexprs, the launch options), to PTX and cubin
with the ``ptxas`` that Triton's wheel carries. Nothing runs and no GPU is needed.

    python tests/runtime/compile_for_gpu.py        (prints one line per launch, then a summary)

Exit status 1 if any launch failed to compile. ``test_kernels_compile_for_a_gpu.py`` runs it.
"""

import inspect
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.kernels import triton_attention, triton_layer_ops

TARGET = GPUTarget("cuda", 90, 32)  # an H100 or H200: compute capability 9.0, 32-lane warps
LAUNCH_OPTIONS = ("num_warps", "num_stages")
POINTER_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
}
SHOWN = ("DECODE", "BITS", "KEYS_PER_CHANNEL", "FOLD_KEYS", "ADD", "NORM")
failures: list[str] = []
compiled: list[str] = []


def argument_type(name: str, value: object) -> str:
    """Triton's signature type of a launch argument: a pointer for a tensor, else a scalar."""
    if isinstance(value, torch.Tensor):
        return "*" + POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__}")


def compile_launch(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
    """Stands in for ``JITFunction.run``: compile this launch for ``TARGET``."""
    options = {key: kwargs.pop(key) for key in LAUNCH_OPTIONS if key in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = argument_type(param.name, value)
    shown = ", ".join(f"{key}={constexprs[key]}" for key in SHOWN if key in constexprs)
    label = f"{kernel.fn.__name__}({shown})"
    started = time.perf_counter()
    try:
        triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)
    except Exception:
        failures.append(label)
        print(f"FAILED {label}\n{traceback.format_exc(limit=2)}", flush=True)
        return
    compiled.append(label)
    print(f"compiled {label} in {time.perf_counter() - started:.1f} s", flush=True)


def caches(kv_cache_dtype: str, keys: str, block_size: int) -> CacheEngine:
    """A CPU cache engine in one format, its layers laid out as on a GPU."""
    shape = CacheShape(1, block_size, 2, 128, torch.float16, kv_cache_dtype, keys)
    return CacheEngine(shape, 8, 0, torch.device("cpu"), residual_slots=2)


def attention(engine: CacheEngine) -> None:
    """A store, a decode (both stages) and a prefill over ``engine``'s layer 0."""
    slots = list(range(4))
    engine.plan_step(slots)  # keys per channel: the step's plan, which the layer carries
    k_cache, v_cache = engine.layer(0)
    key = torch.randn(4, 2, 128, dtype=torch.float16)
    triton_attention.store_kvcache(key, key.clone(), k_cache, v_cache, torch.tensor(slots))
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lengths = torch.tensor([20, 30], dtype=torch.int32)
    query = torch.randn(2, 8, 128, dtype=torch.float16)
    triton_attention.paged_decode_attention(query, k_cache, v_cache, tables, lengths, 0.1)
    cu_seqlens = torch.tensor([0, 1, 2], dtype=torch.int32)
    triton_attention.paged_prefill_attention(
        query, k_cache, v_cache, cu_seqlens, tables, lengths, 0.1
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
    JITFunction.run = compile_launch
    attention(caches("auto", "per_token", 16))
    for bits in (8, 4):
        attention(caches(f"int{bits}", "per_token", 16))
        attention(caches(f"int{bits}", "per_channel", 16))  # a tile inside a block: folded
        attention(caches(f"int{bits}", "per_channel", 8))  # tiles across blocks: per lane
    layer_ops()
    print(f"{len(compiled)} launches compiled for sm_90, {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
