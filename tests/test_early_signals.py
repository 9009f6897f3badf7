"""A stop during start-up: SIGTERM/SIGINT before a router or worker serves ends it cleanly.

Real `python -m router` / `python -m worker` processes on 127.0.0.1 (tests/procs.py). A signal
sent as soon as the process has a handler for it (read from /proc: the earliest moment at which
a handler can exist at all; before it the kernel's default applies to any process), or once the
process says it loads its model, must end it with exit 0 (as the SIGTERM drain does), without a
traceback and without it ever serving. Before the entry points recorded such a signal from their
first line, SIGTERM killed the process (-15: exit 143 from a shell) and SIGINT raised
KeyboardInterrupt's traceback.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess

import pytest

from tests.procs import START_TIMEOUT_S, Proc, start_worker, wait_until

# Off the fixed default ports (9464, 8000) that a router binds otherwise; the worker's address is
# never dialled (the router stops before it probes anything).
ROUTER_ARGS = ("-m", "router", "--port", "0", "--workers", "127.0.0.1:1", "--metrics-port", "-1")
ROUTER_ARGS += ("--http-port", "-1")
EXIT_TIMEOUT_S = 60.0


def handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (SigCgt in /proc/PID/status)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def wait_handles_sigterm(proc: Proc) -> None:
    # SIGTERM is the entry points' last handler (after SIGINT's): once it is in, both are. Python
    # catches SIGINT itself from its own start, so that bit says nothing about the entry point.
    wait_until(
        lambda: proc.popen.poll() is not None or handles(proc.popen.pid, signal.SIGTERM),
        EXIT_TIMEOUT_S,
        f"{proc.name} handling SIGTERM",
        poll_s=0.002,
    )
    assert proc.popen.poll() is None, f"{proc.name} exited before the signal:\n{proc.log_tail()}"


def assert_clean_stop(proc: Proc, sig: int, timeout_s: float = EXIT_TIMEOUT_S, may_serve=False) -> str:
    """Sends `sig`; the process must exit 0 within `timeout_s`, never having served unless
    `may_serve` (then it may also have drained). Its log."""
    proc.signal(sig)
    try:
        code = proc.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.name} still running {timeout_s} s after {sig.name}:\n{proc.log_tail()}")
    log = proc.log_path.read_text(errors="replace")
    assert code == 0, f"{proc.name} exited with {code} after {sig.name}:\n{log[-4000:]}"
    assert "Traceback" not in log, log[-4000:]
    if may_serve and "listening on" in log:
        assert f"{proc.name} stopped" in log, log[-4000:]
        return log
    assert "listening on" not in log, f"{proc.name} served before it stopped:\n{log[-4000:]}"
    assert "during start-up: not serving" in log, log[-4000:]
    return log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("role", ["router", "worker"])
def test_a_signal_right_after_spawn_stops_cleanly(tmp_path, role, sig):
    proc = Proc("router", list(ROUTER_ARGS), tmp_path) if role == "router" else start_worker(tmp_path)
    try:
        wait_handles_sigterm(proc)
        log = assert_clean_stop(proc, sig)
        assert "loading model" not in log  # stopped before the long part of start-up, not after it
    finally:
        proc.stop()


def test_router_stops_cleanly_on_sigterm_while_it_loads_its_model(tmp_path):
    proc = Proc("router", list(ROUTER_ARGS), tmp_path)
    try:
        proc.wait_for_line("loading model", START_TIMEOUT_S)
        # Its tokenizer loads in ~0.6 s: a signal this test sends late may find it serving, and
        # then it drains; either way a clean exit (before this fix, -15 anywhere in start-up).
        assert_clean_stop(proc, signal.SIGTERM, may_serve=True)
    finally:
        proc.stop()


def test_worker_stops_cleanly_on_sigterm_while_it_loads_its_model(tmp_path):
    proc = start_worker(tmp_path)
    try:
        proc.wait_for_line("loading model", START_TIMEOUT_S)
        assert_clean_stop(proc, signal.SIGTERM, START_TIMEOUT_S)
    finally:
        proc.stop()
