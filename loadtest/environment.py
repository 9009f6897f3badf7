"""What a report records about where it ran, so a run can be repeated and judged: git revision,
machine, and (optionally) the server's own Prometheus counters before and after a run.

Contract
- `git_revision()` -> {"commit", "dirty"} of the working tree (or {"commit": "unknown"}).
- `machine()` -> host name, OS, Python, CPU model, logical cores, load average, GPUs (from
  `nvidia-smi -L` when present). Never imports torch.
- `scrape_counters(url)` -> {metric name: value summed over labels} for the counters the report
  compares (`llm_requests_total`, `llm_prompt_tokens_total`, `llm_generation_tokens_total`), or
  {"error": ...}; `counter_deltas(before, after)` subtracts.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import subprocess
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
COUNTERS = ("llm_requests_total", "llm_prompt_tokens_total", "llm_generation_tokens_total")


def _run(args: list[str]) -> str:
    try:
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_revision() -> dict:
    commit = _run(["git", "rev-parse", "HEAD"])
    if not commit:
        return {"commit": "unknown"}
    return {"commit": commit, "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))}


def cpu_model() -> str:
    """The CPU's model name (recorded with every benchmark: the machines vary)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc/cpuinfo (not Linux): fall through to the platform's name
    return platform.processor() or platform.machine()


def machine() -> dict:
    gpus = _run(["nvidia-smi", "-L"]).splitlines() if shutil.which("nvidia-smi") else []
    return {
        "host": platform.node(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpus": gpus,
    }


def scrape_counters(url: str, timeout_s: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8")
    except OSError as exc:
        return {"error": str(exc)}
    # Here, not at the top: bench-host (cpu_model) runs on the GPU machine, which has no
    # prometheus_client.
    from prometheus_client.parser import text_string_to_metric_families

    totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def counter_deltas(before: dict, after: dict) -> dict:
    if "error" in before or "error" in after:
        return {"error": before.get("error") or after.get("error")}
    return {name: after[name] - before.get(name, 0.0) for name in after}
