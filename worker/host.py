"""What the host gives a worker: its cores and the memory still free.

- `default_num_threads()`: OMP_NUM_THREADS when set (Ray sets it from an actor's CPUs), else the
  CPU affinity mask.
- `available_memory_bytes()`: MemAvailable (Linux), else physical memory; a lower cgroup v2 limit
  wins. The CPU KV pool's default budget (worker/model_runner.py) is a fraction of it.
"""

from __future__ import annotations

import contextlib
import os


def default_num_threads() -> int:
    """The cores this process is given: OMP_NUM_THREADS when set (Ray sets it to an actor's
    num_cpus), else the CPU affinity mask."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory; a cgroup limit, where
    one is set and lower, wins."""
    avail = None
    with contextlib.suppress(OSError):  # no /proc/meminfo (not Linux): total physical memory below
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError):  # no cgroup v2 memory files: no container limit to apply
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read().strip())
            avail = min(avail, max(int(limit) - used, 0))
    return avail
