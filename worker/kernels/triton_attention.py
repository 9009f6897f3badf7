"""Triton paged attention over a mixed prefill+decode batch (the GPU twin of the reference).

Contract (same as `worker.kernels.reference.paged_attention`):
- Input: q `[num_tokens, num_heads, head_dim]`, each sequence's new tokens back to back
  (`query_start_loc [num_seqs + 1]`), k_cache/v_cache `[num_blocks, block_size, num_kv_heads,
  head_dim]`, `block_tables [num_seqs, max_blocks]`, `seq_lens [num_seqs]` = cached + new tokens
  (metadata int32; int64 accepted). q and the caches share one float dtype (fp16, bf16, fp32),
  or the caches are float8_e4m3fn under any of those q (`--kv-cache-dtype fp8`: tiles widen to q's
  dtype after the load, so the cache read is halved and the math is unchanged);
  every tensor's last dim is contiguous. The new tokens are the last `query_len` positions of their
  sequence: causal among themselves, full over the cached prefix. GQA: query head h reads kv head
  h // (num_heads // num_kv_heads). Any head_dim up to 256 (padded to a power of two inside).
- Output: `[num_tokens, num_heads, head_dim]`, q's dtype; scores, softmax and the weighted sum
  accumulate in float32 (online softmax). Rows past `query_start_loc[-1]` hold unspecified values.
- State: none (split-KV scratch buffers are allocated per call).
- Fails how: shape, dtype, device or stride mismatch raises ValueError before launch.
- Proven by: tests/test_kernels.py::test_paged_attention_* (relative error vs the reference:
  fp32 < 1e-5, fp16/bf16 < 1e-2), interpreted on CPU or on CUDA; compiled for sm_80/sm_90
  without spills, with tensor cores for fp16/bf16 and no tf32 for fp32, by
  tests/test_triton_compile.py (`make check-triton` for every layout and dtype).

Design: worker/kernels/triton_attention_kernels.py (the two kernels: grid, tiles, split-KV and
the merge). Here: the argument checks, the tile and warp choice per batch, the split count
(`choose_num_splits`; `num_splits=` overrides it) and the launches.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from worker.kernels.triton_attention_kernels import _merge_splits_kernel, _paged_attention_kernel

# Tuned on an H200 (benchmarks/gpu_tune.py, 2026-11-30): a decode batch is split until it launches
# about 16 programs per SM (2 left small batches latency-bound: 1.1 TB/s at batch 1, 32k context,
# vs 1.9 TB/s now), and decode walks keys 64 at a time. Prefill tiles keep 32 keys: 64 spills
# registers at head_dim 128 on sm_80 (`make check-triton`).
TILE_N = 32  # keys per inner-loop step (prefill and mixed batches)
DECODE_TILE_N = 64  # keys per inner-loop step when every sequence computes one token
MAX_SPLITS = 64
MIN_SPLIT_LEN = 128  # a split shorter than this costs more to merge than it saves
PROGRAMS_PER_SM = 16  # split until a decode batch launches about this many programs per SM
MERGE_TILE_ELEMS = 4096  # fp32 partials one merge program holds (heads x splits x head_dim)


# Under TRITON_INTERPRET=1 (set before triton's import) @triton.jit gives interpreter objects.
INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Split the keys only for an all-decode batch that leaves SMs idle and has long contexts."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(target, programs), max_seq_len // MIN_SPLIT_LEN)
    return max(1, splits)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: nothing to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0 or head_dim > 256:
        raise ValueError(
            f"head layout mismatch: q heads {num_heads}x{head_dim}, "
            f"kv heads {num_kv_heads}x{k_cache.shape[3]} (head_dim <= 256)"
        )
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    if (
        q.dtype not in (torch.float16, torch.bfloat16, torch.float32)
        or (q.dtype != k_cache.dtype and not fp8_cache)
        or k_cache.dtype != v_cache.dtype
    ):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError(
            f"metadata ranks: block_tables {block_tables.dim()}, seq_lens "
            f"{seq_lens.dim()}, query_start_loc {query_start_loc.dim()}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"batch mismatch: seq_lens {num_seqs}, query_start_loc "
            f"{query_start_loc.shape[0]}, block_tables {block_tables.shape[0]}"
        )
    meta = (block_tables, seq_lens, query_start_loc)
    if any(t.dtype not in (torch.int32, torch.int64) for t in meta):
        raise ValueError(f"metadata must be int32 or int64, got {[t.dtype for t in meta]}")
    tensors = (q, k_cache, v_cache) + meta
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"tensors on several devices: {[str(t.device) for t in tensors]}")
    if (
        any(t.stride(-1) != 1 for t in (q, k_cache, v_cache))
        or seq_lens.stride(0) != 1
        or query_start_loc.stride(0) != 1
    ):
        raise ValueError("q, caches, seq_lens and query_start_loc need a contiguous last dim")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention into `out` (allocated when None), which is returned.

    `max_query_len`/`max_seq_len` are computed from the tensors when None (a device sync): the
    model runner passes its host-side values. `num_splits` overrides the split-KV choice.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    # A forced split count is honoured for every sequence; a chosen one is capped per sequence.
    min_split_len = 1 if num_splits is not None else MIN_SPLIT_LEN
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must match q {tuple(q.shape)} {q.dtype}: got {tuple(out.shape)} "
            f"{out.dtype} on {out.device} with strides {out.stride()}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    if num_splits is None:
        num_splits = 1
        # Pre-checked here so that a batch that cannot split never pays the max_seq_len sync.
        if max_query_len == 1 and num_seqs * num_kv_heads < PROGRAMS_PER_SM * _num_sms(q.device):
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_splits = choose_num_splits(
                num_seqs, num_kv_heads, max_query_len, max_seq_len, _num_sms(q.device)
            )

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    fp32 = q.dtype == torch.float32
    # Rows of a tile are (token, head-in-group) pairs: at least 16 (the smallest tl.dot), up to 64
    # for prefill chunks (32 in fp32), never fewer than one token's worth of heads. fp32 tiles
    # take 8 warps: 64-row fp32 tiles with 4 warps spilled registers on sm_80/sm_90 (up to 8.5 KB
    # per thread at head_dim 128); `make check-triton` reports registers and spills per case.
    max_block_m = 32 if fp32 else 64
    block_m = max(
        16, triton.next_power_of_2(group), min(max_block_m, triton.next_power_of_2(max_query_len * group))
    )
    block_q = block_m // group
    num_warps = 8 if fp32 else 4
    upcast = INTERPRETED  # the interpreter cannot tl.dot bf16: compute in fp32 there
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused placeholders

    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        num_heads,
        num_splits,
        min_split_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=DECODE_TILE_N if max_query_len == 1 else TILE_N,
        BLOCK_SIZE=k_cache.shape[1],
        SPLIT_KV=num_splits > 1,
        # fp32 must not drop to tf32 (fp32 promises 1e-5); 16-bit inputs take the default.
        DOT_PRECISION="ieee" if fp32 else None,
        UPCAST=upcast,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=num_warps,
    )
    if num_splits > 1:
        splits_pad = triton.next_power_of_2(num_splits)
        block_h = min(
            triton.next_power_of_2(num_heads), max(1, MERGE_TILE_ELEMS // (splits_pad * head_dim_pad))
        )
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out,
            part_out,
            part_lse,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=splits_pad,
            BLOCK_H=block_h,
        )
    return out
