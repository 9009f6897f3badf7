"""Host figures for the CPU benchmarks (`make bench-serve`, `make eval`): what the machine is, how
much memory a process peaked at, and how busy the machine was meanwhile. Linux /proc; standard
library only.

Contract
- `machine_info()` -> {"cpu": model name, "cores": int, "memory_gib": float, "load_average":
  [1, 5, 15 min]} from `lscpu` (with /proc/cpuinfo and os fallbacks: never raises).
- `read_status_kib(pid, key)` -> a "kB" field of /proc/PID/status (VmRSS, VmHWM) in KiB, or None
  when unreadable (process gone, not Linux).
- `RssSampler(pid, interval_s=0.25)`: state = a daemon thread sampling VmRSS every interval;
  `stop()` -> peak RSS in MiB, the larger of the sampled VmRSS and the kernel's VmHWM (call while
  the process is alive), or None when nothing could be read.
- `proc_cpu_s(pid)` -> user + system CPU seconds of a process (all threads), or None.
- `machine_cpu_ticks()` -> (busy, steal, total) jiffies over all CPUs from /proc/stat, or None.
- `CpuMeter(pids)`: `stop()` -> {"busy_cores", "side_cores", "client_cores", "other_cores",
  "steal_cores"} averaged over the interval since construction (other = busy - the side's pids -
  this process, i.e. the load tester); only side/client cores off Linux.
- Tests: tests/test_bench_serve.py (test_cpu_meter_counts_this_process_as_the_client,
  test_rss_sampler_reads_this_process).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

from benchmarks.report import REPO


def _run(args: list[str], timeout_s: float = 10.0) -> str:
    try:
        return subprocess.run(
            args, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """CPU model name and core count as `lscpu` reports them (with /proc and os fallbacks)."""
    fields = {}
    for line in _run(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = fields.get("Model name", "")
    if not model:
        try:
            model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in open("/proc/cpuinfo")
                    if line.startswith("model name")
                ),
                "",
            )
        except OSError:
            model = ""
    cores = int(fields["CPU(s)"]) if fields.get("CPU(s)", "").isdigit() else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return {
        "cpu": model or "unknown",
        "cores": cores,
        "memory_gib": round(mem_gib, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def read_status_kib(pid: int, key: str) -> int | None:
    """A "kB" field of /proc/PID/status (VmRSS, VmHWM), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass  # unreadable /proc entry (process gone, not Linux): no figure
    return None


class RssSampler:
    """Peak resident memory of one process: VmRSS sampled on a thread, and VmHWM (the kernel's own
    high-water mark) read at `stop()`; the peak is the larger."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid, self.interval_s = pid, interval_s
        self.max_kib = 0
        self.hwm_kib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            kib = read_status_kib(self.pid, "VmRSS")
            if kib is not None:
                self.max_kib = max(self.max_kib, kib)
            self._stop.wait(self.interval_s)  # the sampling period, not a synchronization

    def stop(self) -> float | None:
        """Peak RSS in MiB (call while the process is still alive for VmHWM)."""
        self.hwm_kib = read_status_kib(self.pid, "VmHWM")
        self._stop.set()
        self._thread.join(5)
        peak = max(self.max_kib, self.hwm_kib or 0)
        return peak / 1024 if peak else None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies over all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal, sum(values[:8])


class CpuMeter:
    """How busy the machine was while a side was measured, and how much of that was the side:
    `stop()` -> {"busy_cores", "side_cores", "other_cores", "steal_cores"} averaged over the
    interval (other = busy - the side's processes - this process, i.e. the load tester)."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.wall = time.monotonic()
        self.ticks = machine_cpu_ticks()
        self.side = sum(proc_cpu_s(pid) or 0.0 for pid in pids)
        self.own = time.process_time()

    def stop(self) -> dict:
        wall = max(1e-9, time.monotonic() - self.wall)
        side = (sum(proc_cpu_s(pid) or 0.0 for pid in self.pids) - self.side) / wall
        own = (time.process_time() - self.own) / wall
        ticks = machine_cpu_ticks()
        if self.ticks is None or ticks is None or ticks[2] == self.ticks[2]:
            return {"side_cores": round(side, 2), "client_cores": round(own, 2)}
        cores = os.cpu_count() or 1
        span = ticks[2] - self.ticks[2]
        busy = (ticks[0] - self.ticks[0]) / span * cores
        return {
            "busy_cores": round(busy, 2),
            "side_cores": round(side, 2),
            "client_cores": round(own, 2),
            "other_cores": round(max(0.0, busy - side - own), 2),
            "steal_cores": round((ticks[1] - self.ticks[1]) / span * cores, 2),
        }
