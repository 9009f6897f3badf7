"""`python -m benchmarks.cpu_attention`: the CPU attention paths side by side: the "cpu" C++ op, the
"torch" path and the float32 reference.

Protocol: SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token
blocks), one torch thread (`--threads`), a decode step of B sequences whose context lengths are
drawn log-uniformly from 16-768 tokens (seed 0) over blocks scattered through a shuffled pool, in
float32 and bfloat16 (q, K and V all of that dtype). Each path is first checked against the
reference (rel. error <= 1e-5 fp32, 1e-2 bf16), then the three paths run in turn, 3 warm-up and
`--repeats` timed rounds, so that noise from other processes on the machine falls on all of them.
Printed: the best (minimum) time per layer call of each path, the least disturbed run on a shared
machine (`--stat median` prints medians instead). The plan of the torch path is built once (as the
model runner does, once per step for all layers) and not timed.
Columns, per dtype: reference ms, torch ms, how many times faster the cpu op is than torch
("cpu x"), cpu ms, and the K/V bytes the step reads divided by the cpu op's time (GB/s). The K/V
of one layer stays in the last-level cache between calls at the smaller batches, so GB/s can
exceed the DRAM read rate, which goes to stderr with the machine's name for comparison
(a single-thread sum over 256 MiB).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from loadtest.environment import cpu_model
from worker.kernels import cpu_attention, cpu_ext, reference, torch_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 1e-2)}


def decode_batch(num_seqs: int, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    rng = random.Random(seed)
    seq_lens = [int(2 ** rng.uniform(4, 9.58)) for _ in range(num_seqs)]  # 16..768
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    gen = torch.Generator().manual_seed(seed)
    physical = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = physical[first : first + n]
        first += n
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return dict(
        q=torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        scale=HEAD_DIM**-0.5,
    )


def time_ms(fns: dict, repeats: int, stat=min) -> dict:
    """`stat` (min or median) of the ms per call of each fn, timed in turn (round-robin) so
    they share the noise."""
    for _ in range(3):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: stat(t) for name, t in times.items()}


def read_bandwidth_gbs() -> float:
    x = torch.ones(2**26)  # 256 MiB
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    if not err <= tol:
        raise SystemExit(f"{what}: the {name} path differs from the reference (rel. err. {err:.1e})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stat", choices=["min", "median"], default="min")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ext.load()
    print(
        f"{cpu_model()}, {args.threads} thread(s), cpu op {cpu_ext.build_info()}, "
        f"DRAM read {read_bandwidth_gbs():.1f} GB/s (1 thread, 256 MiB sum), {args.stat} of "
        f"{args.repeats} rounds",
        file=sys.stderr,
        flush=True,
    )
    header = f"{'batch':>5} {'tokens':>7}"
    for name in args.dtypes:
        tag = "fp32" if name == "float32" else "bf16"
        header += f"  {tag + ' ref ms':>12} {'torch ms':>9} {'cpu x':>6} {'cpu ms':>7} {'cpu GB/s':>8}"
    print(header, flush=True)
    for num_seqs in args.batch_sizes:
        row = ""
        tokens = 0
        for name in args.dtypes:
            dtype, tol = DTYPES[name]
            batch = decode_batch(num_seqs, seed=0, dtype=dtype)
            tokens = int(batch["seq_lens"].sum())
            plan = torch_attention.plan_attention(
                batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], BLOCK_SIZE
            )
            expected = reference.paged_attention(**batch)
            what = f"batch {num_seqs} {name}"
            check("torch", torch_attention.paged_attention(**batch, plan=plan), expected, tol, what)
            check("cpu", cpu_attention.paged_attention(**batch), expected, tol, what)
            ms = time_ms(
                {
                    "reference": lambda: reference.paged_attention(**batch),
                    "torch": lambda: torch_attention.paged_attention(**batch, plan=plan),
                    "cpu": lambda: cpu_attention.paged_attention(**batch),
                },
                args.repeats,
                min if args.stat == "min" else statistics.median,
            )
            kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * batch["k_cache"].element_size()
            row += (
                f"  {ms['reference']:12.2f} {ms['torch']:9.2f} {ms['torch'] / ms['cpu']:5.1f}x "
                f"{ms['cpu']:7.3f} {kv_bytes / ms['cpu'] / 1e6:8.1f}"
            )
        print(f"{num_seqs:5d} {tokens:7d}{row}", flush=True)


if __name__ == "__main__":
    main()
