"""Building llama.cpp's `llama-server` and `llama-perplexity` once, from the sources vendored in the
PyPI sdist of llama-cpp-python (the peer of our benchmarks: benchmarks/llamacpp.py runs them).

Contract
- `ensure_built(cache_dir=None, log=print) -> Binaries`: returns the two executables, building
  them first when the cache holds no build with the same flags. Steps, each printed as it starts:
  `pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36` into `<cache>/sdist/`,
  unpack its `vendor/llama.cpp` into `<cache>/src/`, `cmake` configure (Release, CPU only,
  GGML_NATIVE on, GGML AMX off, curl/openssl off, no web UI download, static libraries, no tests,
  examples or other tools) and `cmake --build --target llama-server llama-perplexity -j 2` under
  `nice`; cmake output goes to `<cache>/build.log`, build progress lines to `log`. A stamp
  `<cache>/build.json` (version, flags, binaries) marks a finished build; a build is reused only
  when its stamp matches `CMAKE_FLAGS` and both binaries exist (`find_built(root)` -> Binaries or
  None).
  The cache defaults to `~/.cache/llm-serve/llama.cpp-0.3.36`; `$LLM_SERVE_LLAMACPP_DIR` overrides
  (`cache_dir(override)`). CMake is the one on PATH, else `pip install cmake` into this
  interpreter's environment (`find_cmake`).
- state: only the cache directory (outside the repository).
- failure modes: `BuildError` with the reason (failed download, missing compiler, cmake error with
  the log's last lines, a step past its deadline). Nothing is ever written inside the repository.
- Tests: tests/test_llamacpp.py (the cache lookup and the flags; the build itself runs in
  `make bench-serve` / `make eval`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
CACHE_ENV = "LLM_SERVE_LLAMACPP_DIR"
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "llm-serve" / f"llama.cpp-{VERSION}"
TARGETS = ("llama-server", "llama-perplexity")
BUILD_JOBS = 2
# CPU only, tuned for this CPU, AMX off (as in the measurement), no network features
# (curl is deprecated in this version and off anyway; no OpenSSL; the web UI would be downloaded
# from a model hub at build time), static libraries so the binaries stand alone.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF",
)
DOWNLOAD_TIMEOUT_S = 900.0
CONFIGURE_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 5400.0
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


class BuildError(RuntimeError):
    """The llama.cpp build could not be made; the message says why."""


@dataclass(frozen=True)
class Binaries:
    server: pathlib.Path
    perplexity: pathlib.Path
    cache_dir: pathlib.Path
    version: str = VERSION
    built_now: bool = False


def cache_dir(override: str | os.PathLike | None = None) -> pathlib.Path:
    return pathlib.Path(override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _stamp(root: pathlib.Path) -> dict:
    return {
        "package": PACKAGE,
        "flags": list(CMAKE_FLAGS),
        "targets": list(TARGETS),
        "server": str(root / "build" / "bin" / "llama-server"),
        "perplexity": str(root / "build" / "bin" / "llama-perplexity"),
    }


def find_built(root: pathlib.Path) -> Binaries | None:
    """The cached binaries when a finished build with today's flags is there, else None."""
    try:
        stamp = json.loads((root / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    want = _stamp(root)
    if any(stamp.get(k) != want[k] for k in ("package", "flags", "targets")):
        return None
    server, ppl = pathlib.Path(stamp["server"]), pathlib.Path(stamp["perplexity"])
    if not (os.access(server, os.X_OK) and os.access(ppl, os.X_OK)):
        return None
    return Binaries(server, ppl, root)


def _run_logged(cmd: list[str], log_file, timeout_s: float, what: str, log, cwd=None) -> None:
    """Runs `cmd`, its output appended to `log_file`; progress lines ("[ 42%] ...") go to `log`."""
    log_file.write(f"\n$ {' '.join(cmd)}\n")
    log_file.flush()
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {exc}") from None
    fired = threading.Event()

    def kill_group() -> None:  # the step and the compilers it started
        fired.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone

    watchdog = threading.Timer(timeout_s, kill_group)  # the deadline, even when nothing is printed
    watchdog.start()
    last_pct = -1
    try:
        for line in proc.stdout:
            log_file.write(line)
            found = _PROGRESS.match(line)
            if found and int(found.group(1)) != last_pct:
                last_pct = int(found.group(1))
                log(f"  {what}: {line.strip()[:110]}")
        status = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # interrupted (e.g. Ctrl-C): leave no compiler running
            kill_group()
            proc.wait()
        log_file.flush()
    if fired.is_set():
        raise BuildError(f"{what}: not done within {timeout_s:.0f} s (log: {log_file.name})")
    if status != 0:
        tail = pathlib.Path(log_file.name).read_text(errors="replace").splitlines()[-25:]
        raise BuildError(f"{what} failed (exit {status}); last lines of {log_file.name}:\n" + "\n".join(tail))


def find_cmake(log=print) -> str:
    """`cmake` from PATH or this environment's bin/, else installed from PyPI into this env."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(pathlib.Path(sys.executable).parent))
    if found:
        return found
    log("cmake not found: pip install cmake (into this Python environment)")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "cmake"],
        capture_output=True,
        text=True,
        timeout=DOWNLOAD_TIMEOUT_S,
    )
    found = shutil.which("cmake", path=str(pathlib.Path(sys.executable).parent))
    if done.returncode != 0 or not found:
        raise BuildError(f"no cmake on PATH and `pip install cmake` failed:\n{done.stderr[-2000:]}")
    return found


def _download_sdist(root: pathlib.Path, log) -> pathlib.Path:
    sdist_dir = root / "sdist"
    existing = sorted(sdist_dir.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if existing:
        log(f"sdist already downloaded: {existing[0]}")
        return existing[0]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading the sdist of {PACKAGE} (pip download --no-binary :all: --no-deps) ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-binary",
        ":all:",
        "--no-deps",
        PACKAGE,
        "-d",
        str(sdist_dir),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BuildError(f"pip download of {PACKAGE} not done within {DOWNLOAD_TIMEOUT_S:.0f} s") from None
    found = sorted(sdist_dir.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if done.returncode != 0 or not found:
        raise BuildError(
            f"pip download of {PACKAGE} failed (exit {done.returncode}):\n"
            f"{(done.stderr or done.stdout)[-2000:]}"
        )
    return found[0]


def _unpack(tarball: pathlib.Path, root: pathlib.Path, log) -> pathlib.Path:
    """Extracts only vendor/llama.cpp of the sdist into <root>/src (fresh each time)."""
    src = root / "src"
    if src.exists():
        shutil.rmtree(src)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    log(f"unpacking {prefix} from {tarball.name} ...")
    try:
        with tarfile.open(tarball) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            if not members:
                raise BuildError(f"{tarball} holds no {prefix}")
            tar.extractall(src, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise BuildError(f"cannot unpack {tarball}: {exc}") from None
    if not (src / "CMakeLists.txt").is_file():
        raise BuildError(f"{src} has no CMakeLists.txt after unpacking")
    return src


def ensure_built(override: str | os.PathLike | None = None, log=print, jobs: int = BUILD_JOBS) -> Binaries:
    root = cache_dir(override)
    found = find_built(root)
    if found is not None:
        log(f"llama.cpp {VERSION}: using the cached build in {root}")
        return found
    for tool in ("cc", "c++"):
        if not shutil.which(tool) and not shutil.which("gcc" if tool == "cc" else "g++"):
            raise BuildError(
                f"no C/C++ compiler ({tool}) on PATH: install one (e.g. apt-get install build-essential)"
            )
    root.mkdir(parents=True, exist_ok=True)
    (root / "build.json").unlink(missing_ok=True)
    log(f"building llama.cpp {VERSION} ({', '.join(TARGETS)}) into {root}; log: {root / 'build.log'}")
    start = time.monotonic()
    cmake = find_cmake(log)
    tarball = _download_sdist(root, log)
    src = _unpack(tarball, root, log)
    build = root / "build"
    if build.exists():
        shutil.rmtree(build)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    with open(root / "build.log", "w", encoding="utf-8") as log_file:
        log("cmake configure ...")
        _run_logged(
            [*nice, cmake, "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
            log_file,
            CONFIGURE_TIMEOUT_S,
            "configure",
            log,
        )
        log(f"cmake --build (targets {', '.join(TARGETS)}, {jobs} jobs, nice) ...")
        _run_logged(
            [
                *nice,
                cmake,
                "--build",
                str(build),
                "--config",
                "Release",
                "-j",
                str(jobs),
                "--target",
                *TARGETS,
            ],
            log_file,
            BUILD_TIMEOUT_S,
            "build",
            log,
        )
    stamp = _stamp(root)
    for key in ("server", "perplexity"):
        if not os.access(stamp[key], os.X_OK):
            raise BuildError(f"the build finished but {stamp[key]} is missing (log: {root / 'build.log'})")
    stamp["built_s"] = round(time.monotonic() - start, 1)
    stamp["built_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (root / "build.json").write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
    log(f"llama.cpp built in {stamp['built_s'] / 60:.1f} min")
    return Binaries(pathlib.Path(stamp["server"]), pathlib.Path(stamp["perplexity"]), root, built_now=True)
