"""`make bench-host`: host (CPU) time per engine step, with a model that does no math.

Contract / protocol:
- Runs the real `LLMEngine` on CPU: the scheduler, the block manager (prefix caching on, as by
  default), the model runner's input preparation (`ModelRunner.prepare`: token, position, slot,
  block-table and length tensors), the sampler (greedy argmax, or temperature/top-p sampling with
  per-request generators) and the scheduler's update and output bookkeeping. Sampled decoding is
  measured twice: through the torch sampler (the CPU path), and through the fused path a GPU takes
  (`RequestSampler` with its kernel replaced by a stub returning zeros: the per-row parameters,
  Philox seeds and counters and their transfer, which is what the host pays there). The model is a stub:
  a 1-layer `LlamaModel` whose forward returns zeros [T, hidden] and whose `compute_logits` returns
  zeros [S, vocab] (hidden 576 as SmolLM2; vocab 256 by default, since an argmax or softmax over a
  real vocabulary is device math on a GPU, not host overhead). `enforce_eager`: no compiled CPU
  forward, and on CPU no CUDA graphs.
- Workload per batch size B (default 1, 64, 256): B requests, prompts of uniformly drawn lengths
  in [128, 1024] tokens (seeded), ignore_eos and enough max_tokens never to finish while measured.
  The engine steps until every request is admitted and prefilled (every step is then a decode step
  of B sequences), runs warm-up steps, then times `--steps` calls of `engine.step()` with nothing
  wrapped. Step time = the median of the engine thread's CPU time per step (`time.thread_time`; one
  torch thread), which other processes on a shared machine do not inflate the way they inflate
  wall-clock time (descheduled, a step waits whole 4 ms scheduler ticks); the wall-clock median and
  90th percentile are reported next to it. A second, instrumented pass (`--breakdown-steps`)
  wraps each phase (schedule, prepare, model stub, sample, update; the rest is "other") to give a
  CPU-time breakdown.
- Async scheduling (`--async-scheduling`, the engine's overlap path; greedy, a fourth row set):
  the engine thread plans step N+1 and commits step N while an executor thread launches the
  steps, so step time there is the PROCESS's CPU time per `engine.step()` (both threads; one
  torch thread), with no phase breakdown (the phases run on two threads).
- Also measured on the same plans, outside the step time: the CUDA-graph decode path's host-side
  input preparation (`InputBatch.build` + `graph_rows` on its own persistent batch state; it
  replaces `prepare` for decode steps on a GPU).
- Per-sequence slope: least-squares fit of step time against B over the batch sizes.
- Output (rendered by benchmarks/host_report.py): a table (step time and its breakdown),
  results/host_overhead.json, with `--write-docs`
  the section "Host overhead per engine step" of docs/benchmarks.md (added or replaced, the rest of
  the file untouched), and as the LAST line exactly
  `host overhead: B=<largest B> step X ms, per sequence Y us` (greedy sampling).
- Proven by tests/test_host_overhead.py (tiny sizes: format and positive numbers; docs section
  replacement).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.host_report import PHASES, SECTION, docs_section, slope_us, table
from benchmarks.report import git_short, write_section
from loadtest.environment import cpu_model
from loadtest.stats import percentile
from worker.config import EngineConfig, ModelConfig
from worker.cuda_graphs import bucket_for, capture_sizes
from worker.engine import LLMEngine
from worker.input_batch import InputBatch
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

LAST_LINE = re.compile(r"^host overhead: B=(\d+) step (-?[0-9.]+) ms, per sequence (-?[0-9.]+) us$")


class StubModel(LlamaModel):
    """A real LlamaModel (so the runner finds every attribute it uses) that computes nothing."""

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        return torch.zeros(input_ids.shape[0], self.config.hidden_size)

    def compute_logits(self, hidden, upcast=True):
        return torch.zeros(hidden.shape[0], self.config.vocab_size)


def stub_fused_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """The fused sampling kernel's signature (worker/kernels/triton_sampling.py), doing no math."""
    return torch.zeros(logits.shape[0], dtype=torch.int64)


def stub_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=576,
        intermediate_size=64,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        max_position=8192,
        name="no-math stub",
    )


class Timers:
    """Accumulates thread CPU seconds per phase within one engine step."""

    def __init__(self):
        self.step: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] = self.step.get(name, 0.0) + time.thread_time() - start

        return timed


def measure(batch: int, args, temperature: float, fused: bool = False, overlap: bool = False) -> dict:
    """Steady-state decode steps at `batch` sequences: a clean pass (step time only), then an
    instrumented pass (CPU time per phase, and the CUDA-graph path's input preparation).
    `overlap`: async scheduling; the clean pass only, in process CPU time (two threads)."""
    rng = random.Random(args.seed * 1000 + batch)
    lo, hi = args.context
    prompts = [[rng.randrange(args.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]
    budget = max(2048, batch)  # tokens per step while prefilling
    total_steps = 2 * args.warmup + args.steps + args.breakdown_steps
    # Never finishes while measured: a request may already decode while later ones still prefill
    # (at most one step per prefill chunk of the whole batch).
    max_tokens = total_steps + -(-batch * hi // budget) + batch + 16
    block_size = 16
    blocks = batch * -(-(hi + max_tokens + 1) // block_size)
    cfg = stub_config(args.vocab_size)
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        block_size=block_size,
        kv_cache_bytes=blocks * 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        attention_backend="torch",
        enforce_eager=True,
        num_threads=1,
        async_scheduling=overlap,
        num_speculative_tokens=0,  # one token per sequence per step: the host work measured here
    )
    torch.manual_seed(0)
    model = StubModel(cfg).eval()
    engine = LLMEngine(config, runner=ModelRunner.from_model(config, model, name=cfg.name))
    if fused:
        engine.runner.sampler.fused = stub_fused_sample
    sampling = SamplingParams(
        temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=max_tokens, ignore_eos=True
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    sched = engine.scheduler
    setup_start, setup_steps = time.perf_counter(), 0
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        engine.step()
        setup_steps += 1
    setup_s = time.perf_counter() - setup_start
    assert len(sched.running) == batch, "every request admitted at once"

    # Clean pass: nothing wrapped; thread CPU time (what the step costs the host, whatever else
    # runs on the machine) and wall-clock time (which includes being descheduled).
    for _ in range(args.warmup):
        engine.step()
    cpu, wall = [], []
    cpu_time = time.process_time if overlap else time.thread_time
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), cpu_time()
        engine.step()
        c1, w1 = cpu_time(), time.perf_counter()
        cpu.append(c1 - c0)
        wall.append(w1 - w0)
    # Every step above decoded all `batch` sequences: none finished, none was preempted.
    assert len(sched.running) == batch and not sched.waiting and sched.num_preemptions == 0
    row = {
        "batch_size": batch,
        "temperature": temperature,
        "fused": fused,
        "async": overlap,
        "setup_steps": setup_steps,
        "setup_s": setup_s,
        "context_len_mean": sum(map(len, prompts)) / batch,
        "step_ms": statistics.median(cpu) * 1e3,
        "step_wall_ms": statistics.median(wall) * 1e3,
        "step_wall_p90_ms": percentile(wall, 90) * 1e3,
    }
    if overlap:
        assert engine.num_overlapped_steps >= args.steps, "every timed step overlapped the one before"
        engine.close()
        return row

    timers = Timers()
    graph_sizes = capture_sizes(batch)
    runner = engine.runner
    graph_batch = InputBatch(batch, runner.input_batch.max_blocks, block_size, torch.device("cpu"))
    plans = []
    real_schedule = sched.schedule

    def schedule():
        plan = timers.wrap("schedule", real_schedule)()
        plans.append(len(plan.scheduled))
        # The CUDA-graph path's host-side preparation of the same plan (its own persistent batch
        # state: build + padded graph rows); subtracted from the step.
        start = time.thread_time()
        graph_batch.graph_rows(graph_batch.build(plan), bucket_for(len(plan.scheduled), graph_sizes))
        timers.step["graph_inputs"] = time.thread_time() - start
        return plan

    sched.schedule = schedule
    # "prepare": the persistent batch state's per-step work (worker/input_batch.py).
    batch_state = runner.input_batch
    batch_state.build = timers.wrap("prepare", batch_state.build)
    batch_state.eager_inputs = timers.wrap("prepare", batch_state.eager_inputs)
    sched.update = timers.wrap("update", sched.update)
    model.forward = timers.wrap("model_stub", model.forward)
    # "sample": the runner's lm_head call (the stub's zeros) and sampling, greedy fast path included.
    runner._sample = timers.wrap("sample", runner._sample)
    phases: list[dict[str, float]] = []
    try:
        for i in range(args.warmup + args.breakdown_steps):
            timers.step = {}
            start = time.thread_time()
            engine.step()
            step = dict(timers.step)
            step["step"] = time.thread_time() - start - step.get("graph_inputs", 0.0)
            step["other"] = step["step"] - sum(
                v for k, v in step.items() if k not in ("step", "graph_inputs")
            )
            if i >= args.warmup:
                phases.append(step)
    finally:
        del runner._sample, batch_state.build, batch_state.eager_inputs
    assert all(n == batch for n in plans), f"not every measured step was a decode of {batch}: {set(plans)}"
    assert sched.num_preemptions == 0
    row["breakdown_step_ms"] = statistics.median(s["step"] for s in phases) * 1e3
    for k in PHASES + ["graph_inputs"]:
        row[f"{k}_ms"] = statistics.median(s.get(k, 0.0) for s in phases) * 1e3
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument(
        "--context",
        type=int,
        nargs=2,
        default=[128, 1024],
        metavar=("MIN", "MAX"),
        help="prompt (context) lengths, drawn uniformly",
    )
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    p.add_argument("--breakdown-steps", type=int, default=50, help="instrumented steps (phase breakdown)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="also measure sampled decoding at this temperature (0 = greedy only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/host_overhead.json")
    p.add_argument(
        "--write-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="PATH",
        help="add or replace the section in docs/benchmarks.md (or PATH)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    batch_sizes = sorted(args.batch_sizes)
    res = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "git": git_short(),
        "command": "make bench-host" + (' ARGS="' + " ".join(sys.argv[1:]) + '"' if sys.argv[1:] else ""),
        "args": {**vars(args), "batch_sizes": batch_sizes},
        "rows": [],
    }
    print(
        f"host overhead per engine step: {res['machine']}, git {res['git']}, contexts "
        f"{args.context[0]}-{args.context[1]}, {args.steps} timed + {args.breakdown_steps} instrumented "
        "decode steps per batch size; thread CPU time",
        flush=True,
    )
    modes = [("greedy", 0.0, False, False), ("greedy_async", 0.0, False, True)]
    if args.temperature:
        modes += [
            ("sampled", args.temperature, False, False),
            ("sampled_fused", args.temperature, True, False),
        ]
    for kind, temperature, fused, overlap in modes:
        rows = []
        for b in batch_sizes:
            row = measure(b, args, temperature, fused, overlap)
            rows.append(row)
            detail = (
                f"; schedule {row['schedule_ms']:.3f}, prepare {row['prepare_ms']:.3f}, "
                f"sample {row['sample_ms']:.3f}, update {row['update_ms']:.3f}, other {row['other_ms']:.3f}; "
                f"graph-path inputs {row['graph_inputs_ms']:.3f} ms"
                if "prepare_ms" in row
                else " (process CPU time: engine + executor threads)"
            )
            print(
                f"  {kind:13s} B={b:4d}: step {row['step_ms']:8.3f} ms CPU "
                f"({row['step_wall_ms']:.3f} ms wall){detail}",
                flush=True,
            )
        res["rows"] += rows
        res[kind] = {
            "batch_size": rows[-1]["batch_size"],
            "step_ms": rows[-1]["step_ms"],
            "per_sequence_us": slope_us(rows),
        }
    print("\n" + "\n".join(table(res["rows"])))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    if args.write_docs:
        write_section(Path(args.write_docs), SECTION[3:], docs_section(res))
        print(f'wrote the section "{SECTION[3:]}" of {args.write_docs}')
    g = res["greedy"]
    print(
        f"host overhead: B={g['batch_size']} step {g['step_ms']:.3f} ms, "
        f"per sequence {g['per_sequence_us']:.2f} us"
    )


if __name__ == "__main__":
    main()
