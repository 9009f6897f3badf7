"""llama.cpp as the peer of our benchmarks: build `llama-server` and `llama-perplexity` once from
the sources vendored in the PyPI sdist of llama-cpp-python, run the server, parse the tools' output.

Contract
- `ensure_built(cache_dir=None, log=print) -> Binaries` (benchmarks/llamacpp_build.py): the two
  executables, built once into a cache outside the repository; `BuildError` with the reason.
- `LlamaServer(binary, model, threads, parallel, ctx_size)`: `start(timeout_s)` runs llama-server
  on 127.0.0.1 and an ephemeral port and returns once `GET /health` answers 200 (deadline; fails
  early with the log's tail when the process exits); `stop()` terminates it (kill after a grace).
  Its output goes to a temp log file (`log_path`).
- `parse_perplexity(text) -> (ppl, +/-)` from llama-perplexity's "Final estimate: PPL = X +/- Y"
  line; `parse_num_chunks(text)` from "calculating perplexity over N chunks"; `parse_chunk_ppls(text)`
  the running per-chunk estimates "[1]12.3,[2]11.8,..." printed after that line (ValueError when a
  line is missing).
- `python -m benchmarks.llamacpp` builds (or finds) the binaries and prints their paths.
- Tests: tests/test_llamacpp.py (a captured llama-perplexity output parsed, the server's command
  line).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.llamacpp_build import CACHE_ENV, DEFAULT_CACHE, PACKAGE, TARGETS, BuildError, ensure_built
from common.process import terminate

_FINAL_PPL = re.compile(r"Final estimate:\s*PPL\s*=\s*([0-9.]+)\s*\+/-\s*([0-9.]+)")
_CHUNK_PPL = re.compile(r"\[(\d+)\]\s*([0-9.]+|nan|inf)")
_NUM_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def free_port() -> int:
    from common.net import free_port as _free_port

    return _free_port()


class LlamaServer:
    """llama-server on 127.0.0.1:<ephemeral port>, started and stopped by this process."""

    def __init__(
        self,
        binary: pathlib.Path,
        model: pathlib.Path,
        threads: int,
        parallel: int,
        ctx_size: int,
        extra: tuple[str, ...] = (),
    ):
        self.binary, self.model = pathlib.Path(binary), pathlib.Path(model)
        self.threads, self.parallel, self.ctx_size = threads, parallel, ctx_size
        self.extra = tuple(extra)
        self.port = 0
        self.popen: subprocess.Popen | None = None
        self.log_path: pathlib.Path | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int | None = None) -> list[str]:
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port if port is None else port),
            "-t",
            str(self.threads),
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx_size),
            *self.extra,
        ]

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path else ""
        except OSError:
            return ""

    def start(self, timeout_s: float = 180.0) -> str:
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        self.log_path = pathlib.Path(name)
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.popen.returncode} before it was "
                    f"ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as reply:
                    if reply.status == 200:
                        return self.url
                    last = f"HTTP {reply.status}"
            except urllib.error.HTTPError as exc:  # 503 while the model loads
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)  # polling an HTTP endpoint of another process: no event to wait on
        self.stop()
        raise TimeoutError(f"llama-server not healthy within {timeout_s} s ({last}):\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.popen is None:
            return None
        terminate(self.popen, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.popen.returncode


def parse_perplexity(text: str) -> tuple[float, float]:
    """(PPL, its +/-) from llama-perplexity's "Final estimate: PPL = 12.3456 +/- 0.1234"."""
    found = _FINAL_PPL.search(text)
    if not found:
        raise ValueError("no 'Final estimate: PPL = ...' line in llama-perplexity's output")
    return float(found.group(1)), float(found.group(2))


def parse_num_chunks(text: str) -> int:
    """The chunk count from "perplexity: calculating perplexity over 19 chunks, n_ctx=512, ..."."""
    found = _NUM_CHUNKS.search(text)
    if not found:
        raise ValueError("no 'calculating perplexity over N chunks' line in llama-perplexity's output")
    return int(found.group(1))


def parse_chunk_ppls(text: str) -> list[float]:
    """The running estimates llama-perplexity prints after each chunk: "[1]9.81,[2]10.2,..." (the
    text after its "calculating perplexity over" line, when there is one)."""
    found = _NUM_CHUNKS.search(text)
    tail = text[found.end() :] if found else text
    tail = tail.split("Final estimate", 1)[0]
    return [float(v) for _, v in _CHUNK_PPL.findall(tail)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.llamacpp",
        description=f"build llama.cpp's {' and '.join(TARGETS)} once ({PACKAGE} sdist)",
    )
    p.add_argument("--cache-dir", default=None, help=f"default ${CACHE_ENV} or {DEFAULT_CACHE}")
    a = p.parse_args(argv)
    try:
        found = ensure_built(a.cache_dir, log=lambda m: print(m, flush=True))
    except BuildError as exc:
        print(f"llama.cpp build failed: {exc}", file=sys.stderr)
        return 1
    print(f"llama-server:     {found.server}\nllama-perplexity: {found.perplexity}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
