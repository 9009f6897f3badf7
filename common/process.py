"""Stopping a child process: `terminate(popen, timeout_s) -> returncode`.

SIGTERM (the servers here drain on it), wait up to `timeout_s`, then SIGKILL and wait for the exit;
a process already gone is left as it is. Returns the exit status (negative: the signal). Used by
every launcher of a server process: devtools/local.py (make serve), benchmarks/serve_sides.py and
benchmarks/llamacpp.py (bench-serve's two sides), tests/procs.py (the test suite's processes).
"""

from __future__ import annotations

import signal
import subprocess


def terminate(popen: subprocess.Popen, timeout_s: float) -> int:
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    return popen.returncode
