"""The C kernels of the CPU path, compiled once per machine and loaded with ``ctypes`` (given).

Two sources and the header they share (``cpu_math.h``) make one library: ``paged_decode.c``
(decode attention read in place: ``cpu_attention``) and ``layer_ops.c`` (a layer's norms, rotary
turn, activation and KV store: ``layer_ops``). They are compiled with the system's C compiler
(``$CC``, else ``cc``) into ``$VKV_CACHE_DIR`` (default ``~/.cache/vkv``), under a name derived
from the sources, the flags, the compiler and the CPU. Without a compiler, when the build fails,
or with ``VKV_CPU_KERNEL=0`` in the environment, ``library()`` is None and every caller falls
back to its PyTorch definition, with the same results up to float rounding.
"""

import contextlib
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
from torch.autograd import profiler
from torch.profiler import record_function

SOURCES = (Path(__file__).with_name("paged_decode.c"), Path(__file__).with_name("layer_ops.c"))
HEADERS = (Path(__file__).with_name("cpu_math.h"),)  # included by the sources: in the name too
# -march=native: the library is built on the machine that runs it (its name includes the CPU);
# -fopenmp: the loops over sequences and tokens run on OpenMP threads (with PyPI's torch on
# Linux, the libgomp torch loaded, so one thread pool serves both); a compiler that refuses a set
# of flags gets the next one (Apple's clang has no OpenMP: one thread); -fno-trapping-math:
# without it gcc will not vectorize the exponential's float-to-int conversion (it could raise a
# floating-point exception, which nothing here watches)
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"],
    ["-O3", "-fopenmp", "-fno-trapping-math"],
    ["-O3"],
)

_lock = threading.Lock()
_state: dict[str, object] = {}


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None if it cannot be had."""
    with _lock:
        if "library" not in _state:
            _state["library"] = None
            if os.environ.get("VKV_CPU_KERNEL", "1") != "0":
                path = _build()
                loaded = None if path is None else _load(path)
                if loaded is not None:
                    _state["library"], _state["path"] = loaded, path
        return _state["library"]  # type: ignore[return-value]


def library_path() -> Path | None:
    """The compiled library in use, or None when the CPU path runs on PyTorch alone."""
    library()
    return _state.get("path")  # type: ignore[return-value]


def labelled(name: str) -> contextlib.AbstractContextManager:
    """A range named ``name`` (``vkv::...``) in torch's profiler around a C call, while a
    profiler records (torch's own flag, which ``profile_all_threads`` sets for every thread, or
    this thread's profiler state); otherwise nothing. A range costs about 5 microseconds, and a
    full decode step of vkv-tiny (about 8.5 ms) makes some 30 of these calls. Not seen: an
    ``ExecutionTraceObserver`` recording without a profiler."""
    if profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


def _build() -> Path | None:
    """Compile ``SOURCES`` into the cache directory (once), or None without a working compiler.

    When the cache directory cannot be written (a read-only home), the library is built in a
    private temporary directory for this process alone (never in a shared one, whose files
    another user could have planted)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    cache = Path(os.environ.get("VKV_CACHE_DIR", Path.home() / ".cache" / "vkv"))
    for flags in FLAG_SETS:
        described = [" ".join(flags).encode(), compiler.encode(), _cpu_name().encode()]
        key = hashlib.sha256(b"\0".join([*sources, *described])).hexdigest()[:16]
        target = cache / f"vkv-cpu-{key}.so"
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
                command = [compiler, *flags, "-fPIC", "-shared", "-o", str(built)]
                subprocess.run(
                    [*command, *map(str, SOURCES), "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: a concurrent build loses nothing
            return target
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def _load(path: Path) -> ctypes.CDLL | None:
    """The library at ``path`` with its functions' argument types; None if it does not load."""
    pointer, int64, int32, single = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "vkv_paged_decode_f32": ([pointer] * 6 + [int64] * 8 + [single], ctypes.c_int),
        "vkv_add_rms_norm_f32": ([pointer] * 4 + [int64] * 3 + [int32, single], None),
        "vkv_qk_norm_rotary_f32": ([pointer] * 7 + [int64] * 7 + [single], ctypes.c_int),
        "vkv_silu_and_mul_f32": ([pointer] * 2 + [int64] * 3, None),
        "vkv_store_kv_f32": ([pointer] * 5 + [int64] * 7, ctypes.c_int),
    }
    try:
        loaded = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in signatures.items():
            function = getattr(loaded, name)
            function.argtypes, function.restype = argtypes, restype
    except (OSError, AttributeError):
        return None
    return loaded


def _cpu_name() -> str:
    """The CPU model, so that a library built with -march=native is not reused elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    described = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n".join(described)
