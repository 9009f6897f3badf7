"""Fused sampling kernel vs the current torch path (issue 19, item 4; for `make bench-gpu`).

Contract
- `sampling_bench(device, vocab_sizes, batch_sizes, iters, ...) -> list[dict]`, one row per
  (vocab, batch): {vocab, batch, torch_ms, fused_ms, speedup, same_tokens}. Every row samples with
  temperature 0.8, top_k 50, top_p 0.95 from bf16 logits (randn x 2, seeded).
  - torch: what the model runner does for non-greedy rows today: the float32 copy of the logits,
    then worker/sampler.py `sample` (adjust_logits, `sampling_logits` with its sort, softmax, one
    `exponential_` per row from that row's `torch.Generator`, argmax), no logprobs.
  - fused: worker/kernels/triton_sampling.py `fused_sample` on the bf16 logits (per-row seeds,
    offsets), then the same copy of the S tokens to the host that `sample` ends with.
  - speedup = torch_ms / fused_ms; same_tokens: fused_sample and `reference_fused_sample` give the
    same tokens for one shared uniform noise tensor, on the float32 logits the bf16 ones were
    rounded from (a guard, not timed: at 128k tokens bf16 logits tie at the top-k / top-p
    boundary, where the kernel keeps every tied token and the sort exactly k).
- Timing: `warmup` calls, then `iters` calls each between two CUDA events after a synchronize
  (host work and launches included, as the engine pays them); the median. On CPU (the Triton
  interpreter; a smoke test only, tests/test_triton_sampling.py) perf_counter instead.
- `rows_to_markdown(rows) -> str`: the table. `python -m benchmarks.gpu_sampling` prints it.
- Fails how: errors propagate; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from worker.sampling_ops import sample
from worker.types import SamplingParams

TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.95


def _median_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def bench_case(vocab: int, batch: int, device: torch.device, iters: int, warmup: int, **kernel_args) -> dict:
    from worker.kernels.triton_sampling import fused_sample, reference_fused_sample

    gen = torch.Generator().manual_seed(vocab * 1000 + batch)
    base = (torch.randn(batch, vocab, generator=gen) * 2).to(device)  # float32: no ties (guard)
    logits = base.to(torch.bfloat16)
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)] * batch
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
    temperature = torch.full((batch,), TEMPERATURE, device=device)
    top_k = torch.full((batch,), TOP_K, dtype=torch.int32, device=device)
    top_p = torch.full((batch,), TOP_P, device=device)
    min_p = torch.zeros(batch, device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    offsets = torch.zeros(batch, dtype=torch.int64, device=device)
    knobs = (temperature, top_k, top_p, min_p, seeds, offsets)

    def torch_path():
        return sample(logits.float(), params, generators)

    def fused_path():
        return fused_sample(logits, *knobs, **kernel_args).tolist()

    noise = torch.rand(batch, vocab, generator=gen).clamp_min(1e-12).to(device)
    same = bool(
        (
            fused_sample(base, *knobs, noise, **kernel_args)
            == reference_fused_sample(base, temperature, top_k, top_p, min_p, noise)
        ).all()
    )
    torch_ms = _median_ms(torch_path, device, iters, warmup)
    fused_ms = _median_ms(fused_path, device, iters, warmup)
    return {
        "vocab": vocab,
        "batch": batch,
        "torch_ms": torch_ms,
        "fused_ms": fused_ms,
        "speedup": torch_ms / fused_ms,
        "same_tokens": same,
    }


def sampling_bench(
    device,
    vocab_sizes=(49152, 128256),
    batch_sizes=(1, 64, 256),
    iters: int = 20,
    warmup: int = 3,
    **kernel_args,
) -> list[dict]:
    """Rows {vocab, batch, torch_ms, fused_ms, speedup, same_tokens}; `kernel_args` (probes,
    block) go to `fused_sample`."""
    device = torch.device(device)
    with torch.no_grad():
        return [
            bench_case(v, b, device, iters, warmup, **kernel_args) for v in vocab_sizes for b in batch_sizes
        ]


def rows_to_markdown(rows: list[dict]) -> str:
    lines = [
        f"Sampling, temperature {TEMPERATURE}, top_k {TOP_K}, top_p {TOP_P}, bf16 logits: torch = float32 "
        "copy + worker/sampler.py `sample` (per-row generators); fused = `fused_sample`. Median ms.",
        "",
        "| vocab | batch | torch ms | fused ms | speedup | same tokens |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['batch']} | {r['torch_ms']:.3f} | {r['fused_ms']:.3f} "
            f"| {r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # before triton is first imported: kernels run in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = sampling_bench(
        args.device, args.vocab, args.batch, args.iters, probes=args.probes, block=args.block
    )
    print(rows_to_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
