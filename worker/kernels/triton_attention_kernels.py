"""The Triton kernels of paged attention (worker/kernels/triton_attention.py launches them, checks
their arguments and chooses the split count; its docstring is the contract).

- `_paged_attention_kernel`: one program per (sequence, query tile, kv head x split); writes the
  output rows of its tile, or with SPLIT_KV a normalized fp32 partial output
  `[num_tokens, num_heads, num_splits, head_dim]` and its log-sum-exp (base 2)
  `[num_tokens, num_heads, num_splits]` (lse = -inf for a split its sequence does not use).
- `_merge_splits_kernel`: one program per (token, BLOCK_H query heads): the log-sum-exp weighted
  mean of the used splits' partial outputs, in the output's dtype.
- Every tile size and layout choice is a constexpr argument: no module state; the launcher's
  settings (TILE_N, DECODE_TILE_N, ...) live in triton_attention.py.
- Proven by tests/test_kernels.py (vs the reference, interpreted on CPU or on CUDA) and
  tests/test_triton_compile.py (`make check-triton`: compiled for sm_80/sm_90 without spills).

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

import triton
import triton.language as tl


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
