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

Design. Grid `(num_seqs, query tiles, num_kv_heads * num_splits)`. A program owns one kv head and
`BLOCK_Q` query tokens of one sequence, and processes all `group` query heads that share the kv
head together: its `BLOCK_M = BLOCK_Q * group` rows (row m = token m // group, head m % group)
form one tile, so each K/V tile is loaded once per group rather than once per query head. It
walks the keys in tiles (`DECODE_TILE_N` keys for an all-decode batch, `TILE_N` otherwise),
looking up each key's physical block in the block table,
and stops at the last key its last query token can see. Split-KV (flash decoding): with
`num_splits > 1` each program only covers its share of its sequence's keys and writes a
normalized partial output plus its log-sum-exp; `_merge_splits_kernel` combines them. Each
sequence uses only `min(num_splits, ceil(seq_len / MIN_SPLIT_LEN))` splits, computed on the device
(the other programs write lse = -inf and exit), so a CUDA graph recorded with the split count of
the longest context launches mostly empty programs for short ones, not short splits. The
split path pays off when a decode batch has too few (sequence, kv head) programs to fill the GPU
and long contexts to walk; `choose_num_splits` picks it, `num_splits=` overrides it. The split
count is a runtime argument (only "split or not" is compiled in), so a batch whose split count
changes from step to step does not trigger a recompile.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

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


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    num_heads,
    num_splits,
    min_split_len,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_r,
    stride_k_h,
    stride_v_b,
    stride_v_r,
    stride_v_h,
    stride_bt_s,
    stride_bt_b,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # (M,) token within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # (M,) query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context_len + q_idx  # (M,) sees keys 0..q_pos
    if SPLIT_KV:
        # This sequence's own split count, on the device: no split shorter than min_split_len
        # keys, so a short context inside a graph recorded for the longest one skips most splits.
        seq_splits = tl.minimum(num_splits, tl.maximum(tl.cdiv(seq_len, min_split_len), 1))
        if split >= seq_splits:
            part = ((q_start + q_idx) * num_heads + head) * num_splits + split
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return
    q = tl.load(
        q_ptr + (q_start + q_idx)[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (M, D)
    if UPCAST:
        q = q.to(tl.float32)

    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    if SPLIT_KV:
        split_len = tl.cdiv(tl.cdiv(seq_len, seq_splits), TILE_N) * TILE_N
        kv_start = split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)
    else:
        kv_start = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for n0 in range(kv_start, kv_end, TILE_N):
        k_idx = n0 + offs_n  # (N,) key positions
        k_ok = k_idx < kv_end
        block = tl.load(
            block_tables_ptr + seq * stride_bt_s + (k_idx // BLOCK_SIZE) * stride_bt_b, mask=k_ok, other=0
        ).to(tl.int64)
        row = k_idx % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_k_b
            + row[None, :] * stride_k_r
            + kv_head * stride_k_h
            + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (D, N)
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_v_b
            + row[:, None] * stride_v_r
            + kv_head * stride_v_h
            + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (N, D)
        if KV_FP8:  # an fp8 cache: tiles widen to q's dtype (exact), the dots run in q's dtype
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
        s = tl.where(k_ok[None, :] & (k_idx[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        # p is rounded to q's (= the cache's, or for fp8 caches the widened tiles') dtype as the
        # tensor-core path does; UPCAST keeps that rounding.
        p = p.to(q_ptr.dtype.element_ty)
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    token = q_start + q_idx
    # l = 0 only where a row saw no key: padding rows, or (split path) keys past its position.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if not SPLIT_KV:
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # A row that saw nothing gets weight 0 in the merge.
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = (token * num_heads + head) * num_splits + split  # (M,) [token, head, split]
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_heads,
    num_splits,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per (token, BLOCK_H query heads): log-sum-exp weighted mean of the split outputs.
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    d_ok = offs_d < HEAD_DIM
    hs_ok = h_ok[:, None] & (offs_s[None, :] < num_splits)  # (H, S)
    part = (token * num_heads + offs_h[:, None]) * num_splits + offs_s[None, :]  # (H, S)
    lse = tl.load(part_lse_ptr + part, mask=hs_ok, other=float("-inf"))
    lse_max = tl.max(lse, 1)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max)[:, None])  # (H, S)
    # A split its sequence skipped wrote only lse = -inf: its partial output is never read.
    used = hs_ok & (lse > float("-inf"))
    parts = tl.load(
        part_out_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=used[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # (H, S, D)
    total = tl.sum(weight, 1)  # 0: padding head
    out = tl.sum(parts * weight[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


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
