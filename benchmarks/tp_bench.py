"""Tensor-parallel step cost: per-step time and the all-reduce share at TP = 1, 2, 3 (issue 20).

Contract
- input: `python -m benchmarks.tp_bench [--sizes 1,2,3] [--batch 8] [--prompt-len 64] [--steps 24]
  [--device cpu|cuda] [--dtype float32] [--model PATH] [--threads 1] [--write-docs]`. The default
  model is a random Llama with SmolLM2-135M's shapes (hidden 576, MLP 1536, 30 layers, vocabulary
  49,152) but 12 q / 6 KV heads of dim 48 instead of 9 / 3 of dim 64, so that TP 1, 2 and 3 all
  split it (the embedded SmolLM2's 3 KV heads allow TP 1 and 3 only: `--model` it for those).
- output: one row per size: median decode step (ms) of `batch` sequences on rank 0, the seconds
  rank 0 spent inside all-reduces per step (including waiting for the slowest rank), their share of
  the step, the all-reduces per step, one bare all-reduce of a decode step's partials (batch x
  hidden; every rank doing only that: the communication without waiting for a slower rank) and
  that times the all-reduces per step, the prefill step of the batch, rank 0's lm_head time for
  the batch (at TP > 1 vocab-parallel: its slice, the others' in parallel, and the gather) and a
  bare collective of the gather's size (batch x vocab/N). Printed as a Markdown table; with
  --write-docs also written as the "Tensor parallel" section of docs/benchmarks.md.
- on CPU this is a communication figure (gloo over loopback, one thread per rank, ranks sharing
  the machine's cores), not a speed claim; on a machine with N GPUs `--device cuda` gives the NCCL
  figure with the same command.
- state: none; every group is stopped before the next size starts.
- proven by: tests/test_tp_model.py covers the group it drives; this file only measures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.types import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "## Tensor parallel: step time and all-reduce share"


def smollm2_shaped(path: Path, seed: int = 0) -> Path:
    """Random safetensors Llama of SmolLM2-135M's sizes with 12 q / 6 KV heads (see the docstring)."""
    from deploy.sim_cluster import write_tiny_llama  # (the Ray helpers there load lazily)

    return write_tiny_llama(path, seed=seed, sizes=(576, 1536, 30, 12, 6), name="smollm2-shaped-random")


def build(size: int, args) -> tuple[LLMEngine, object]:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization="none",
        device=args.device,
        kv_cache_bytes=64 * 2**20 if args.device == "cpu" else None,
        num_threads=args.threads,
        tensor_parallel_size=size,
        enforce_eager=True,
        max_num_batched_tokens=max(512, args.batch * args.prompt_len),
        max_num_seqs=max(64, args.batch),
    )
    if size == 1:
        return LLMEngine(config), None
    from worker.tp.runner import build_runner

    runner, group = build_runner(config)
    return LLMEngine(config, runner), group


def measure(size: int, args) -> dict:
    engine, group = build(size, args)
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.info.vocab_size
        total = args.warmup + args.steps + 1
        for i in range(args.batch):
            prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            sampling = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
            engine.add_request(f"b{i}", prompt, sampling)
        start = time.perf_counter()
        engine.step()  # the whole batch's prompts in one step
        prefill_ms = (time.perf_counter() - start) * 1e3
        for _ in range(args.warmup):
            engine.step()
        steps, reduce_s, reduces = [], 0.0, 0
        for _ in range(args.steps):
            before = (group.collectives.reduce_s, group.collectives.num_reduces) if group else (0.0, 0)
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
            if group:
                reduce_s += group.collectives.reduce_s - before[0]
                reduces += group.collectives.num_reduces - before[1]
        dtype = engine.runner.model.dtype
        shape = (args.batch, engine.runner.model_config.hidden_size)  # one decode step's partials
        bare_ms = group.time_all_reduce(shape, 50, dtype) * 1e3 if group else 0.0
        # What a vocab-parallel lm_head would add per step: rank 0 collecting the S x V/N logit
        # slices; timed as a bare all-reduce of that size (an all-gather moves as much per rank).
        gather_ms = group.time_all_reduce((args.batch, vocab // size), 10, dtype) * 1e3 if group else 0.0
        model = engine.runner.model
        hidden = torch.randn(args.batch, engine.runner.model_config.hidden_size, dtype=model.dtype)
        hidden = hidden.to(engine.runner.device)
        with torch.inference_mode():
            model.compute_logits(hidden)
            start = time.perf_counter()
            for _ in range(10):
                model.compute_logits(hidden)
            if hidden.is_cuda:
                torch.cuda.synchronize()
            lm_head_ms = (time.perf_counter() - start) * 1e2
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        engine.step()
    finally:
        if group is not None:
            group.stop()
    step_ms = statistics.median(steps) * 1e3
    mean_step_ms = statistics.fmean(steps) * 1e3
    reduce_ms = reduce_s / args.steps * 1e3
    return {
        "size": size,
        "step_ms": step_ms,
        "reduce_ms": reduce_ms,
        "share": reduce_ms / mean_step_ms,
        "reduces": reduces // args.steps,
        "bare_ms": bare_ms,
        "gather_ms": gather_ms,
        "prefill_ms": prefill_ms,
        "lm_head_ms": lm_head_ms,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| TP | decode step (median ms) | in all-reduce (ms/step) | share of step | all-reduces/step "
        "| bare all-reduce (ms) | x per step (ms) | prefill step (ms) | lm_head, rank 0 (ms) "
        "| logit slices collected (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['step_ms']:.1f} | {r['reduce_ms']:.1f} | {r['share']:.0%} | {r['reduces']} "
            f"| {r['bare_ms']:.3f} | {r['bare_ms'] * r['reduces']:.1f} | {r['prefill_ms']:.0f} "
            f"| {r['lm_head_ms']:.2f} | {r['gather_ms']:.2f} |"
        )
    return "\n".join(lines)


def write_docs(text: str) -> None:
    docs = DOCS.read_text()
    pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
    if SECTION in docs:
        docs = pattern.sub(lambda _: text.rstrip() + "\n", docs)
    else:
        docs = docs.rstrip() + "\n\n" + text
    DOCS.write_text(docs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.tp_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,2,3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    if args.model is None:
        import tempfile

        args.model = str(smollm2_shaped(Path(tempfile.mkdtemp(prefix="tp-bench-")) / "model"))
        described = "random Llama of SmolLM2-135M's sizes with 12 q / 6 KV heads (head dim 48), 30 layers"
    else:
        described = args.model
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows.append(measure(size, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    model = described
    command = "python -m benchmarks.tp_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"{SECTION}\n\n{datetime.date.today().isoformat()}, {platform.machine()} {args.device}, "
        f"{os.cpu_count() if args.device == 'cpu' else torch.cuda.device_count()} "
        f"{'CPUs' if args.device == 'cpu' else 'GPUs'}; {model}, {args.dtype}, "
        f"batch {args.batch} x {args.prompt_len}-token prompts, {args.steps} decode steps after "
        f"{args.warmup} warm-up, "
        f"{args.threads} torch thread(s) per rank. Command: `{command.strip()}`.\n\n{table(rows)}\n\n"
        '"in all-reduce" is rank 0\'s time inside the collectives during the steps, waiting for the slowest '
        'rank included; "bare all-reduce" is one collective of a decode step\'s partials with every rank '
        'doing nothing else; "lm_head" is the batch\'s logits on rank 0 (at TP > 1 vocab-parallel: its '
        'slice while the others compute theirs, then the gather); "logit slices collected" is a bare '
        "collective of the gather's size (batch x vocab/N). On CPU the ranks share the machine's cores: "
        "when ranks x threads exceed the CPUs, these include waiting for descheduled ranks. "
        "A communication figure, not a speed claim (docs/tensor-parallel.md).\n"
    )
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
