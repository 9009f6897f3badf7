"""The "cpu" attention backend: a batched paged-attention C++ op, built on first use, and its loader.

Contract: `paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)` is
the contract of `worker.kernels.reference.paged_attention` (flat batch of new tokens, each
sequence's new tokens are its last query_len positions, causal among themselves and full over the
cached prefix, GQA, q/K/V float32, bfloat16 or float16, returns q's dtype, softmax and
accumulation in float32). It runs `torch.ops.llm_cpu.paged_attention` (worker/kernels/
cpu_attention.cpp): the whole batch, all heads, one call, K/V read in place from the paged cache.
Prefill chunks run through the same kernel: measured against torch's SDPA flash kernel (which the
op can call for chunks of `sdpa_min_query_len` rows or more), it was 1.6-7x faster at every chunk
length tried, 16-1,024 new tokens with and without a cached prefix (docs/kernels.md), so the
default `SDPA_MIN_QUERY_LEN = 0` never calls SDPA. The op has a fake (meta) implementation, so
torch.compile traces a model that calls it without a graph break.

Build: `load()` compiles the .cpp files (this op's, worker/kernels/cpu_fused.cpp's, cpu_quant.cpp's
and cpu_layers.cpp's) with torch.utils.cpp_extension.load (ninja, -O3 -march=native, -fopenmp
against the OpenMP runtime torch itself loaded, so there is one thread pool) into `$LLM_CPU_EXT_DIR`
(default ~/.cache/llm-serve/torch_extensions)/llm_cpu_attention_<key>, where <key> hashes the
sources, torch's version and install path, the compiler's version, -march and the CPU's flags: a
machine with other flags (AVX2 only, say) builds its own copy. Concurrent builders (several workers
starting at once) take an flock on the build directory first, which the kernel releases if a builder
dies, so the torch file baton (`lock`) a killed builder left behind is removed instead of being
waited on forever. `python -m worker.kernels.cpu_build` (run by `make install`) builds it ahead of
time. `LLM_CPU_EXT_MARCH` overrides -march (the tests build an AVX2-only copy with it).

Fails how: bad shapes or dtypes raise ValueError (reference.check_attention_args, then the op's
own checks: a sequence longer than its block-table row, a block id outside the pool,
query_len > seq_len). A build that fails (no compiler, no ninja, a compile error) makes `load()`
raise RuntimeError and `available()` return False with `unavailable_reason()` naming why; the
"auto" backend then falls back to "torch" with one warning (worker/attention.py).
Proven by tests/test_cpu_attention.py (against the reference, the AVX2 build, concurrent builds,
torch.compile fullgraph, the engine's greedy tokens vs the torch backend).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from worker.kernels.reference import check_attention_args

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# The extension's source files: the attention op, and the fused norm / RoPE / SiLU ops of the
# "cpu" backend's `fused` namespace (worker/kernels/cpu_fused.py) and the int4 dequantization of
# worker/kernels/cpu_quant.py, which SOURCE includes (one translation unit: torch's headers parsed
# once). All are hashed and copied; SOURCE is compiled.
SOURCES = (
    SOURCE,
    SOURCE.with_name("cpu_fused.cpp"),
    SOURCE.with_name("cpu_quant.cpp"),
    SOURCE.with_name("cpu_layers.cpp"),
)
# Prefill chunks with at least this many new tokens run through SDPA inside the op; 0: none (the
# paged kernel was faster at every length measured, docs/kernels.md "CPU").
SDPA_MIN_QUERY_LEN = 0

_lock = threading.Lock()
_state: dict = {}  # "path" and "build_s" once loaded, or "error" once a load failed


def cache_root() -> Path:
    return Path(
        os.environ.get("LLM_CPU_EXT_DIR") or Path.home() / ".cache" / "llm-serve" / "torch_extensions"
    )


def march() -> str:
    return os.environ.get("LLM_CPU_EXT_MARCH", "native")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass  # no /proc/cpuinfo (not Linux): the build key then lacks CPU flags
    import platform

    return platform.machine() + " " + platform.processor()


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split(
            "\n"
        )[0]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cxx}: {exc}"


def build_name() -> str:
    """llm_cpu_attention_<key>: one build per source x torch x compiler x -march x CPU flags."""
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    h = hashlib.sha256()
    for part in (
        *(src.read_bytes() for src in SOURCES),
        importlib.metadata.version("torch").encode(),
        str(torch_dir).encode(),
        _compiler_version().encode(),
        march().encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return "llm_cpu_attention_" + h.hexdigest()[:16]


def _openmp_runtime() -> str | None:
    """Path of the OpenMP runtime torch loaded into this process (libgomp, libiomp5 or libomp)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().split()[-1].startswith("/")}
    except OSError:
        return None
    runtimes = sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp5", "libomp")))
    return runtimes[0] if runtimes else None


def _build_flags() -> tuple[list[str], list[str]]:
    cflags = ["-O3", f"-march={march()}"]
    ldflags = []
    omp = _openmp_runtime()
    if omp:
        # Compile the OpenMP pragmas of at::parallel_for, but link the runtime torch already has
        # (same soname: the dynamic loader reuses it), never the compiler's own copy.
        cflags.append("-fopenmp")
        ldflags += [omp, f"-Wl,-rpath,{os.path.dirname(omp)}"]
    return cflags, ldflags


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the pip package ships the binary

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        bindir = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(bindir, "ninja")):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _build(verbose: bool) -> tuple[str, float]:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    name = build_name()
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = _build_flags()
    start = time.perf_counter()
    with open(build_dir / "build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            # Holding the flock, no live builder of ours holds torch's baton: one left behind is stale.
            (build_dir / "lock").unlink(missing_ok=True)
            for src in SOURCES:
                copy = build_dir / src.name  # a stable path: ninja rebuilds when a command changes
                if not copy.exists() or copy.read_bytes() != src.read_bytes():
                    tmp = build_dir / (src.name + ".tmp")
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, copy)
            path = cpp_extension.load(
                name=name,
                sources=[str(build_dir / SOURCE.name)],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return str(path), time.perf_counter() - start


def _register_fake() -> None:
    @torch.library.register_fake("llm_cpu::paged_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sdpa_min_query_len):
        return q.new_empty(q.shape)  # contiguous (T, H, D), q's dtype

    from worker.kernels import cpu_fused, cpu_quant

    cpu_fused.register_fakes()
    cpu_quant.register_fakes()


def _reason(exc: BaseException) -> str:
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0][:160] if lines else ""
    detail = next((line for line in lines[1:] if "error:" in line.lower()), "")  # the compiler's
    return (f"{type(exc).__name__}: {first}" + (f" ... {detail}" if detail else ""))[:600]


def load(verbose: bool = False) -> str:
    """Build (or find in the cache) and load the op once per process; returns the library path.
    Raises RuntimeError naming why if it cannot."""
    with _lock:
        if "path" in _state:
            return _state["path"]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            path, build_s = _build(verbose)
            _register_fake()
        except Exception as exc:  # noqa: BLE001 - any build or load failure: record why
            _state["error"] = f"the llm_cpu attention extension did not build or load: {_reason(exc)}"
            raise RuntimeError(_state["error"]) from exc
        _state.update(path=path, build_s=build_s)
        return path


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    return _state.get("error")


def build_info() -> str:
    """The SIMD path compiled in ("avx512", "avx2" or "scalar") and whether OpenMP is on."""
    load()
    return torch.ops.llm_cpu.build_info()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sdpa_min_query_len: int = SDPA_MIN_QUERY_LEN,
) -> torch.Tensor:
    """Paged attention over the whole batch in one op call; `sdpa_min_query_len=0` keeps every
    prefill chunk in the paged kernel."""
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if "path" not in _state:
        load()
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    if query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    return torch.ops.llm_cpu.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale), int(sdpa_min_query_len)
    )
