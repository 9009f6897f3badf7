"""Paged attention in plain torch, fast enough for serving on CPU: the "torch" attention backend.

Contract: the same as `worker.kernels.reference.paged_attention` (shapes, dtypes, GQA, causal
within the new tokens and full over the cached prefix), plus an optional `plan` from
`plan_attention`, built once per step and shared by every layer.

Why not the reference: the reference upcasts everything to float32 and runs scaled-dot-product
attention with a mask for every sequence. Here a decode row (one new token, most of a serving
step) is two small matmuls over the sequence's K/V, gathered a whole 16-token block at a time
(`index_select` of contiguous blocks, not a per-token gather into a padded batch, which cost 4x the
model's matmuls at 64 sequences); prefill chunks use SDPA (`is_causal` when there is no cached
prefix). Softmax is in float32 for every dtype (decode rows upcast; SDPA's CPU flash kernel
accumulates in float32).
Proven by tests/test_torch_attention.py (against the reference on ragged, mid-block, GQA 1/3/8,
permuted-block batches in fp32/bf16/fp16) and by the engine-vs-transformers tests, which run this
backend. Speed: `make bench-attention` (this vs the reference, side by side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.kernels.reference import check_attention_args


@dataclass
class SeqPlan:
    """One sequence's share of a step."""

    q_start: int  # first row of its new tokens in q
    q_len: int  # new tokens
    seq_len: int  # cached + new tokens
    blocks: torch.Tensor  # (ceil(seq_len / block_size),) int64 physical block ids
    mask: torch.Tensor | None  # (q_len, seq_len) bool for a chunk after a cached prefix, else None


def plan_attention(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
) -> list[SeqPlan]:
    starts = query_start_loc.tolist()
    tables = block_tables.long()
    lens = seq_lens.tolist()
    if lens and max(lens) > tables.shape[1] * block_size:
        raise ValueError(
            f"a sequence of {max(lens)} tokens needs more than the {tables.shape[1]} "
            f"blocks of {block_size} its block table row holds"
        )
    plans = []
    for i, seq_len in enumerate(lens):
        q_start, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        mask = None
        if 1 < q_len < seq_len:
            # New token j sits at position seq_len - q_len + j and sees keys up to it.
            keys = torch.arange(seq_len, device=tables.device)
            queries = torch.arange(seq_len - q_len, seq_len, device=tables.device)
            mask = keys[None, :] <= queries[:, None]  # (Q, L)
        plans.append(SeqPlan(q_start, q_len, seq_len, tables[i, : -(-seq_len // block_size)], mask))
    return plans


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: list[SeqPlan] | None = None,
) -> torch.Tensor:
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for p in plan:
        k = k_cache.index_select(0, p.blocks).flatten(0, 1)[: p.seq_len]  # (L, Hkv, D)
        v = v_cache.index_select(0, p.blocks).flatten(0, 1)[: p.seq_len]
        if p.q_len == 1:
            qg = q[p.q_start].reshape(num_kv_heads, group, head_dim).float()  # (Hkv, G, D)
            scores = torch.bmm(qg, k.float().permute(1, 2, 0)).mul_(scale)  # (Hkv, G, L)
            probs = scores.softmax(dim=-1)
            out[p.q_start] = torch.bmm(probs, v.float().transpose(0, 1)).view(-1, head_dim)
        else:
            rows = slice(p.q_start, p.q_start + p.q_len)
            # 4-D inputs: with 3-D ones torch's CPU SDPA skips its flash kernel (3.5x slower).
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=True,
            )  # (1, H, Q, D)
            out[rows] = o[0].transpose(0, 1)
    return out
