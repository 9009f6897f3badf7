"""Async scheduling on CPU: the same offline workload through a synchronous and an async engine.

Contract: `python -m benchmarks.async_sched [--requests 16] [--tokens 64] [--repeats 3]
[--dtypes float32,bfloat16] [--threads N]` loads the embedded SmolLM2 once per dtype (float32:
dequantized weights; bfloat16: the default, GGUF weights kept quantized) and runs, alternately and
`--repeats` times each after one warm-up, `--requests` greedy requests of distinct ~30-token prompts
and `--tokens` output tokens (ignore_eos), all added at once, through `LLMEngine.generate` with
`async_scheduling` off and on over the same runner. Reports per dtype the median output tok/s of
each mode, async / sync, the engine's overlapped and synchronous step counts, and checks the
outputs are identical (it fails otherwise). Prints a markdown table with the CPU model, writes JSON
to results/async_sched/<UTC time>.json. Wall clock on a shared machine: compare within one run.
Engines are built and driven off the main thread (as the worker does,
worker/async_engine.build_engine_off_main_thread), so no idle OpenMP team of the main thread skews
either mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from loadtest.environment import cpu_model

CONFIGS = {
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="auto"),
}
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly".split()


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n distinct prompts of about 30 tokens (word orders from a fixed rotation: no shared prefix)."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(24)]
        out.append(tokenizer.encode(f"Story {i}: " + " ".join(words)))
    return out


def timed_run(engine, batch, sampling) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = engine.generate(batch, sampling)
    return time.perf_counter() - start, out


def bench_dtype(name: str, args) -> dict:
    from worker.async_engine import on_new_thread
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    config = EngineConfig(
        kv_cache_bytes=256 * 2**20, max_num_seqs=64, num_threads=args.threads, **CONFIGS[name]
    )
    sync = on_new_thread(lambda: LLMEngine(config))
    overlapped = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=sync.runner)
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    batch = prompts(Tokenizer.from_gguf(default_model_path()), args.requests)
    sampling = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines = {"sync": sync, "async": overlapped}
    times: dict[str, list[float]] = {"sync": [], "async": []}
    outputs = {}
    for mode, engine in engines.items():  # warm-up (compiled attention op, allocator)
        on_new_thread(lambda engine=engine: timed_run(engine, batch, sampling))
    steps_before = (overlapped.num_overlapped_steps, overlapped.num_sync_steps)
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            seconds, outputs[mode] = on_new_thread(lambda engine=engine: timed_run(engine, batch, sampling))
            times[mode].append(seconds)
    if outputs["sync"] != outputs["async"]:
        raise AssertionError(f"{name}: async scheduling changed the tokens")
    overlapped.close()
    n_tokens = args.requests * args.tokens
    tok_s = {mode: n_tokens / statistics.median(ts) for mode, ts in times.items()}
    return {
        "dtype": name,
        "sync_tok_s": tok_s["sync"],
        "async_tok_s": tok_s["async"],
        "ratio": tok_s["async"] / tok_s["sync"],
        "times_s": times,
        "overlapped_steps": overlapped.num_overlapped_steps - steps_before[0],
        "sync_steps": overlapped.num_sync_steps - steps_before[1],
        "attention_backend": sync.runner.backend.name,
        "threads": sync.runner.config.num_threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores given)")
    args = parser.parse_args()
    rows = [bench_dtype(name, args) for name in args.dtypes.split(",")]
    machine = f"{cpu_model()}, {os.cpu_count()} vCPUs"
    print(f"machine: {machine}; {args.requests} requests x {args.tokens} tokens, median of {args.repeats}")
    print(
        "| dtype | threads | attention | sync tok/s | async tok/s | async / sync | overlapped / sync steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['threads']} | {r['attention_backend']} | {r['sync_tok_s']:.1f} | "
            f"{r['async_tok_s']:.1f} | {r['ratio']:.3f} | {r['overlapped_steps']} / {r['sync_steps']} |"
        )
    out_dir = Path("results/async_sched")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (out_dir / f"{stamp}.json").write_text(
        json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
