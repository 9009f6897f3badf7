"""`python -m benchmarks.cpu_attention`: the CPU attention path vs the float32 reference, side by side.

Protocol: SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token
blocks, fp32), one torch thread, a decode step of B sequences whose context lengths are drawn
log-uniformly from 16-768 tokens (seed 0) over blocks scattered through a shuffled pool. Each path
runs 3 warm-up and `--repeats` timed calls per batch size; the median time per layer call is
printed with the ratio and the K/V bytes the step reads per second. The plan of the torch path is
built once (as the model runner does, once per step for all layers) and not timed.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from worker.kernels import reference, torch_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_batch(num_seqs: int, seed: int) -> dict:
    rng = random.Random(seed)
    seq_lens = [int(2 ** rng.uniform(4, 9.58)) for _ in range(num_seqs)]            # 16..768
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    gen = torch.Generator().manual_seed(seed)
    physical = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = physical[first:first + n]
        first += n
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return dict(q=torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen),
                k_cache=torch.randn(shape, generator=gen), v_cache=torch.randn(shape, generator=gen),
                block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32), scale=HEAD_DIM ** -0.5)


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>5} {'tokens':>7} {'reference ms':>13} {'torch ms':>9} {'ratio':>6} {'torch GB/s':>10}")
    for num_seqs in args.batch_sizes:
        batch = decode_batch(num_seqs, seed=0)
        plan = torch_attention.plan_attention(batch["block_tables"], batch["seq_lens"],
                                              batch["query_start_loc"], BLOCK_SIZE)
        expected = reference.paged_attention(**batch)
        got = torch_attention.paged_attention(**batch, plan=plan)
        err = ((got - expected).abs().max() / expected.abs().max()).item()
        if err > 1e-5:
            raise SystemExit(f"batch {num_seqs}: torch path differs from the reference (rel. err. {err:.1e})")
        ref_ms = median_ms(lambda: reference.paged_attention(**batch), args.repeats)
        fast_ms = median_ms(lambda: torch_attention.paged_attention(**batch, plan=plan), args.repeats)
        tokens = int(batch["seq_lens"].sum())
        kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * 4
        print(f"{num_seqs:5d} {tokens:7d} {ref_ms:13.2f} {fast_ms:9.2f} {ref_ms / fast_ms:5.1f}x "
              f"{kv_bytes / fast_ms / 1e6:10.2f}")


if __name__ == "__main__":
    main()
