"""The torch backend on a CPU: the reference, with decode attention read in place (given).

``vkv.kernels.reference.paged_decode_attention`` defines decode attention by gathering every
block of every sequence into one padded tensor, then masking the padding: simple, and what the
Triton kernels are checked against, but on a CPU the gather is the larger part of attention's
time (each layer and step copies the whole batch's K/V, padding included, then reads the copy).
Here ``paged_decode_attention`` runs ``paged_decode.c`` instead: a loop over each sequence's
block table that reads its blocks where they lie, with an online softmax, one sequence per
OpenMP thread at a time. Storing and prefill attention are the reference's.

What it buys (``benchmarks/bench_cpu_attention.py``, 2 cores): a quarter to two fifths of the
reference's time for one call whose blocks are in the CPU's caches; inside a ``vkv bench e2e``
run, where each layer's K/V come from memory, about three quarters (the blocks are fetched a few
ahead, since no hardware prefetcher follows a block table).

The C file is compiled once per machine with the system's C compiler (``$CC``, else ``cc``)
into ``$VKV_CACHE_DIR`` (default ``~/.cache/vkv``), under a name derived from the source, the
flags, the compiler and the CPU, then loaded with ``ctypes``. Without a compiler, when the build
fails, with ``VKV_CPU_KERNEL=0`` in the environment, or for a cache it does not handle (not
float32, quantized, not contiguous), decode attention falls back to the reference, with the same
results up to float rounding (``tests/runtime/test_cpu_attention.py`` compares the two). A block
table that does not cover its context with blocks of the cache is refused (``ValueError``)
before anything is read: the reference would read block 0 for a -1.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from vkv.kernels import reference
from vkv.kernels.reference import paged_prefill_attention, store_kvcache

__all__ = ["kernel_path", "paged_decode_attention", "paged_prefill_attention", "store_kvcache"]

SOURCE = Path(__file__).with_name("paged_decode.c")
# -march=native: the library is built on the machine that runs it (its name includes the CPU);
# -fopenmp: the loop over sequences runs on OpenMP threads (with PyPI's torch on Linux, the
# libgomp torch loaded, so one thread pool serves both); a compiler that refuses a set of flags
# gets the next one (Apple's clang has no OpenMP: one thread); -fno-trapping-math: without it
# gcc will not vectorize the exponential's float-to-int conversion (it could raise a floating-
# point exception, which nothing here watches)
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"],
    ["-O3", "-fopenmp", "-fno-trapping-math"],
    ["-O3"],
)

_lock = threading.Lock()
_state: dict[str, object] = {}


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_decode_attention``'s contract; computed in place when it can be."""
    kernel = _kernel()
    if kernel is None or not _handles(query, k_cache, v_cache, block_tables, context_lens):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale
        )
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    status = kernel(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        k_cache.shape[0],
        scale,
    )
    if status != 0:
        raise ValueError(
            "paged_decode_attention: a context is empty or longer than its block table, or a "
            f"table names a block outside the cache of {k_cache.shape[0]} blocks"
        )
    return out


def kernel_path() -> Path | None:
    """The compiled library in use, or None when decode attention falls back to the reference."""
    _kernel()
    return _state.get("path")  # type: ignore[return-value]


def _handles(query, k_cache, v_cache, block_tables, context_lens) -> bool:
    """Whether the C loop applies: float32 tensors on the CPU, contiguous, int32 tables."""
    tensors = (query, k_cache, v_cache)
    return (
        all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in tensors)
        and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and block_tables.dtype == torch.int32
        and context_lens.dtype == torch.int32
        and query.shape[1] % k_cache.shape[2] == 0
    )


def _kernel():
    """The loaded C function, built on first use; None if it cannot be had."""
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = None
            if os.environ.get("VKV_CPU_KERNEL", "1") != "0":
                path = _build()
                function = None if path is None else _load(path)
                if function is not None:
                    _state["kernel"], _state["path"] = function, path
        return _state["kernel"]


def _build() -> Path | None:
    """Compile ``SOURCE`` into the cache directory (once), or None without a working compiler.

    When the cache directory cannot be written (a read-only home), the library is built in a
    private temporary directory for this process alone (never in a shared one, whose files
    another user could have planted)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("VKV_CACHE_DIR", Path.home() / ".cache" / "vkv"))
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), compiler.encode(), _cpu_name().encode()])
        ).hexdigest()[:16]
        target = cache / f"paged_decode-{key}.so"
        if target.exists():
            return target
        try:
            try:
                cache.mkdir(parents=True, exist_ok=True)
                folder = cache
            except OSError:
                folder = Path(tempfile.mkdtemp(prefix="vkv-"))
                target = folder / target.name
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                built = Path(scratch) / target.name
                subprocess.run(
                    [compiler, *flags, "-fPIC", "-shared", "-o", str(built), str(SOURCE), "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: a concurrent build loses nothing
            return target
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def _load(path: Path):
    """The C function of the library at ``path``; None if it does not load."""
    try:
        function = ctypes.CDLL(str(path)).vkv_paged_decode_f32
    except (OSError, AttributeError):
        return None
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer] * 6 + [int64] * 7 + [ctypes.c_float]
    function.restype = ctypes.c_int
    return function


def _cpu_name() -> str:
    """The CPU model, so that a library built with -march=native is not reused elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    described = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n".join(described)
