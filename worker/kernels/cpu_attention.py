"""The "cpu" attention backend: a batched paged-attention C++ op (in the llm_cpu extension, which
worker/kernels/cpu_ext.py builds on first use and loads).

Contract: `paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)` is
the contract of `worker.kernels.reference.paged_attention` (flat batch of new tokens, each
sequence's new tokens are its last query_len positions, causal among themselves and full over the
cached prefix, GQA, q/K/V float32, bfloat16 or float16, returns q's dtype, softmax and
accumulation in float32). It runs `torch.ops.llm_cpu.paged_attention` (worker/kernels/
cpu_attention.cpp): the whole batch, all heads, one call, K/V read in place from the paged cache.
Prefill chunks run through the same kernel: measured against torch's SDPA flash kernel (which the
op can call for chunks of `sdpa_min_query_len` rows or more), it was 1.6-7x faster at every chunk
length tried, 16-1,024 new tokens with and without a cached prefix (docs/kernels.md), so the
default `SDPA_MIN_QUERY_LEN = 0` never calls SDPA. The op has a fake (meta) implementation
(registered by cpu_ext when the library loads), so torch.compile traces a model that calls it
without a graph break.

Fails how: bad shapes or dtypes raise ValueError (reference.check_attention_args, then the op's
own checks: a sequence longer than its block-table row, a block id outside the pool,
query_len > seq_len). A library that does not build makes the call raise RuntimeError naming why
(cpu_ext.load); the "auto" backend then falls back to "torch" with one warning (worker/attention.py).
Proven by tests/test_cpu_attention.py (against the reference, the AVX2 build, concurrent builds,
torch.compile fullgraph, the engine's greedy tokens vs the torch backend).
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_ext
from worker.kernels.reference import check_attention_args

__all__ = ["SDPA_MIN_QUERY_LEN", "paged_attention"]

# Prefill chunks with at least this many new tokens run through SDPA inside the op; 0: none (the
# paged kernel was faster at every length measured, docs/kernels.md "CPU").
SDPA_MIN_QUERY_LEN = 0


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sdpa_min_query_len: int = SDPA_MIN_QUERY_LEN,
) -> torch.Tensor:
    """Paged attention over the whole batch in one op call; `sdpa_min_query_len=0` keeps every
    prefill chunk in the paged kernel."""
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    ops = cpu_ext.ops()
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    if query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    return ops.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale), int(sdpa_min_query_len)
    )
