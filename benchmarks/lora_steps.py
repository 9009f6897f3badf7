"""The cost of a LoRA adapter inside one engine step: decode steps of the base model and of an
adapter, in process, at several batch sizes.

Contract
- input: `--model` (GGUF; the embedded SmolLM2 by default), `--threads` (2), `--rank` (16),
  `--rows` (1,8,32: sequences decoding together), `--steps` (20 timed steps per point),
  `--rounds` (3; base and adapter alternate inside each round).
- the adapter: benchmarks/lora.py `write_adapter`, every layer's seven projections.
- protocol: one engine (worker/engine.py) with the adapter loaded and speculative decoding off;
  per point, `rows` greedy requests (distinct prompts of 16 tokens, ignore_eos) all of the base
  model or all of the adapter, stepped until every sequence decodes, then `--steps` decode steps
  timed (wall clock around `engine.step()`, whose output is on the host when it returns).
- output: per rows, the median step ms of base and adapter and their ratio, and the C++
  `lora_add` alone over all of the adapter's linears with its weights in cache (what the step adds
  beyond streaming them from memory); the CPU model and revision; a markdown table (docs/lora.md,
  "Cost, measured").
- failure modes: none handled: an engine error is a traceback.
- proven by: tests/test_lora.py covers what these steps compute; this only times them.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ADAPTER = "bench"


def time_steps(engine, rows: int, adapter: str, steps: int, tag: str) -> float:
    """Median wall ms of `steps` decode steps with `rows` sequences of `adapter` ("" = base)."""
    from worker.types import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, adapter=adapter)
    for i in range(rows):
        prompt = [1] + [(1000 + 37 * i + 11 * j) % 30000 for j in range(15)]
        engine.add_request(f"{tag}-{i}", prompt, sampling)
    while engine.scheduler.waiting or any(not s.num_output_tokens for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def time_kernel(engine, rows: int, reps: int = 20) -> float:
    """Median ms of the C++ lora_add over every linear of every layer for `rows` rows, the
    adapter's own weights (slot 1), in cache (the op alone, no step around it)."""
    import torch

    tensors = engine.runner.adapters._op_weights[1]
    triples = [tensors[i : i + 3] for i in range(0, len(tensors), 3) if tensors[i].numel()]
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, a.shape[1], generator=gen).bfloat16() for a, _, _ in triples]
    outs = [torch.randn(rows, bt.shape[1], generator=gen).bfloat16() for _, bt, _ in triples]
    index = torch.arange(rows)
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        for (a, bt, shards), x, out in zip(triples, xs, outs):
            torch.ops.llm_cpu.lora_add_(out, x, a, bt, shards, index)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_steps", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from benchmarks.lora import projection_shapes, write_adapter
    from benchmarks.report import git_short
    from benchmarks.structured_output import _cpu
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.tp.shard import read_model_config

    cfg = read_model_config(args.model)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-lora-steps-"))
    adapter = write_adapter(work / ADAPTER, cfg.num_layers, projection_shapes(cfg), args.rank, 0, 0.02)
    rows = [int(r) for r in args.rows.split(",")]
    settings = dict(
        num_threads=args.threads,
        num_speculative_tokens=0,
        max_num_seqs=max(rows),
        lora_modules=(f"{ADAPTER}={adapter}",),
    )
    if args.model:
        settings["model"] = args.model
    engine = LLMEngine(EngineConfig(**settings))
    found: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for n in rows:
            for name in ("", ADAPTER) if rnd % 2 == 0 else (ADAPTER, ""):
                ms = time_steps(engine, n, name, args.steps, f"r{rnd}-{n}-{name or 'base'}")
                found.setdefault((n, name), []).append(ms)
                print(f"round {rnd} rows {n} {name or 'base'}: {ms:.2f} ms", flush=True)
    lines = [
        f"LoRA in the engine step, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_cpu()}, "
        f"{args.threads} threads, rev {git_short()}, rank {args.rank}, seven projections, "
        f"median of {args.rounds} rounds x {args.steps} decode steps",
        "",
        "| rows | base ms | adapter ms | adapter / base | lora_add alone ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    op = engine.runner.cpu_layers is not None
    for n in rows:
        base, lora = statistics.median(found[(n, "")]), statistics.median(found[(n, ADAPTER)])
        kernel = f"{time_kernel(engine, n):.2f}" if op else "- (no C++ layer op)"
        lines.append(f"| {n} | {base:.2f} | {lora:.2f} | {lora / base:.2f} | {kernel} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
