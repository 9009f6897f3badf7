"""The llm_cpu C++ extension: builds, loads and describes the library behind the "cpu" backend's
ops (the attention op of worker/kernels/cpu_attention.py, the fused ops of cpu_fused.py, the
quantized linears of cpu_quant.py, the decoder-layer stack of cpu_layers.py). The op modules import
this one and never each other.

Contract
- `load(verbose=False) -> str`: builds (or finds in the cache) and loads the library once per
  process and returns its path; raises RuntimeError naming why if it cannot (no compiler, no
  ninja, a compile error), and every later call raises the same error without building again.
- `ops()`: `torch.ops.llm_cpu`, loading the library first if needed (no lock once it is loaded:
  torch.compile traces the op modules' calls through it).
- `available() -> bool`, `unavailable_reason() -> str | None` (why the load failed, None before a
  failure), `library_path()` / `build_seconds()` (None until loaded), `build_info()` (the SIMD
  path compiled in: "avx512", "avx2" or "scalar", and whether OpenMP is on; loads first).
- `build_name()`, `cache_root()`, `march()`: where a build goes (below).
- state: this module's load record (path and seconds, or the failure), behind a lock; nothing else
  reads it but through the functions above.

Build: the .cpp files (SOURCE, worker/kernels/cpu_attention.cpp, which includes cpu_fused.cpp,
cpu_quant.cpp and cpu_layers.cpp: one translation unit, torch's headers parsed once) are compiled
with torch.utils.cpp_extension.load (ninja, -O3 -march=native, -fopenmp against the OpenMP runtime
torch itself loaded, so there is one thread pool) into `$LLM_CPU_EXT_DIR` (default
~/.cache/llm-serve/torch_extensions)/llm_cpu_attention_<key>, where <key> hashes the sources,
torch's version and install path, the compiler's version, -march and the CPU's flags: a machine
with other flags (AVX2 only, say) builds its own copy. Concurrent builders (several workers
starting at once) take an flock on the build directory first, which the kernel releases if a
builder dies, so the torch file baton (`lock`) a killed builder left behind is removed instead of
being waited on forever. `python -m worker.kernels.cpu_build` (run by `make install`) builds it
ahead of time. `LLM_CPU_EXT_MARCH` overrides -march (the tests build an AVX2-only copy with it).
Once loaded, every op gets its fake (meta) kernel here (`_register_fakes`: shapes and dtypes
only), so torch.compile traces a model that calls them without a graph break.
Proven by tests/test_cpu_attention.py (the cached build and its entry point, the AVX2 build,
concurrent builders and a stale lock, the fallback when the build fails, torch.compile fullgraph)
and the op modules' tests (tests/test_cpu_fused.py, tests/test_cpu_quant.py, tests/test_cpu_layers.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# The extension's source files: the attention op, and the fused norm / RoPE / SiLU ops of the
# "cpu" backend's `fused` namespace (worker/kernels/cpu_fused.py), the int4 / int8 ops of
# worker/kernels/cpu_quant.py and the layer stack of worker/kernels/cpu_layers.py, which SOURCE
# includes (one translation unit: torch's headers parsed once). All are hashed and copied; SOURCE
# is compiled.
SOURCES = (
    SOURCE,
    SOURCE.with_name("cpu_fused.cpp"),
    SOURCE.with_name("cpu_quant.cpp"),
    SOURCE.with_name("cpu_layers.cpp"),
)

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


def _register_fakes() -> None:
    """Meta implementations (shapes and dtypes only) of every op, registered once when the library
    loads (they need its schemas)."""

    @torch.library.register_fake("llm_cpu::paged_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sdpa_min_query_len):
        return q.new_empty(q.shape)  # contiguous (T, H, D), q's dtype

    # the fused ops (worker/kernels/cpu_fused.py)
    @torch.library.register_fake("llm_cpu::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("llm_cpu::rms_norm_residual")
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("llm_cpu::rotary_embedding")
    def _(positions, q, k, cos, sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("llm_cpu::rope_store_kv")
    def _(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return q.new_empty(q.shape)

    @torch.library.register_fake("llm_cpu::silu_and_mul")
    def _(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("llm_cpu::argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.int64)

    # the quantized linears (worker/kernels/cpu_quant.py)
    @torch.library.register_fake("llm_cpu::int4_dequant_t")
    def _(packed, scales_and_zeros, group_size, repeats):
        return packed.new_empty((packed.shape[1] * 2 // repeats, packed.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake("llm_cpu::int8_linear_tiled")
    def _(x, q, scale, tile):
        return x.new_empty((x.shape[0], q.shape[0]))

    @torch.library.register_fake("llm_cpu::int4_vnni_linear")
    def _(x, wq, sz):
        return x.new_empty((x.shape[0], wq.shape[0] * 16))

    @torch.library.register_fake("llm_cpu::int8_vnni_linear")
    def _(x, wq, corr, scale):
        return x.new_empty((x.shape[0], wq.shape[0] * 16))

    @torch.library.register_fake("llm_cpu::int8_vnni_embedding")
    def _(wq, scale, ids):
        return scale.new_empty((ids.shape[0], wq.shape[1] * 4))


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
            _register_fakes()
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


def ops():
    """torch.ops.llm_cpu, the library loaded first if it is not yet (RuntimeError naming why if it
    cannot build)."""
    if "path" not in _state:  # (no lock once loaded: torch.compile traces this)
        load()
    return torch.ops.llm_cpu


def library_path() -> str | None:
    """The loaded library's path, None before a successful load."""
    return _state.get("path")


def build_seconds() -> float | None:
    """How long the build (or the cache check) took in this process, None before a load."""
    return _state.get("build_s")
