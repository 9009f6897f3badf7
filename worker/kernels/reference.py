"""Plain-torch reference kernels: the CPU attention backend and the oracle for the Triton kernels.

Contract (shared with worker/kernels/triton_*.py):
- Paged KV cache: one tensor per layer for K and one for V, shape
  `[num_blocks, block_size, num_kv_heads, head_dim]`. Token slot `s` lives at block `s // block_size`,
  row `s % block_size`.
- `store_kv(key, value, k_cache, v_cache, slot_mapping)`: key/value `[num_tokens, num_kv_heads,
  head_dim]`, `slot_mapping [num_tokens] int64`; slots < 0 are skipped (padding). Writes in place.
- `paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)`:
  q `[num_tokens, num_heads, head_dim]` holding each sequence's new tokens back to back
  (`query_start_loc [num_seqs + 1] int32`), `seq_lens [num_seqs] int32` = cached + new tokens,
  `block_tables [num_seqs, max_blocks] int32`. The new tokens are the last `query_len` positions of
  each sequence: causal among themselves, full over the cached prefix. GQA: query head h reads KV
  head h // (num_heads // num_kv_heads). Returns `[num_tokens, num_heads, head_dim]`, q's dtype;
  softmax is computed in float32.
- Fails how: shape or dtype mismatch raises ValueError before any work.
- Proven by: tests/test_kernels.py (Triton vs this) and tests/test_engine_hf.py (engine logits vs
  transformers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"head layout mismatch: q heads {num_heads}x{head_dim}, "
                         f"kv heads {num_kv_heads}x{k_cache.shape[3]}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"batch mismatch: seq_lens {num_seqs}, query_start_loc "
                         f"{query_start_loc.shape[0]}, block_tables {block_tables.shape[0]}")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"store_kv shapes: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    slot_mapping = slot_mapping.long()
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass
class GroupPlan:
    """Index tensors for one padded group of sequences; shared by every layer of a step."""
    slots: torch.Tensor       # (S, L) int64: cache slot of each context position
    rows: torch.Tensor        # (S, Q) int64: q row of each padded query (padding -> a valid row)
    valid: torch.Tensor       # (S, Q) bool: real queries
    mask: torch.Tensor        # (S, 1, Q, L) bool: which keys each query sees


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int) -> list[GroupPlan]:
    """Split the batch into decodes (one new token) and prefill chunks and pad each group apart:
    padding a decode to a 512-token chunk would cost 512x its work."""
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    device = block_tables.device
    plans = []
    for idx in ([i for i, n in enumerate(q_lens) if n == 1], [i for i, n in enumerate(q_lens) if n > 1]):
        if not idx:
            continue
        sel = torch.tensor(idx, device=device)
        lens_ctx = seq_lens[sel].long()
        max_len = int(lens_ctx.max())
        k_idx = torch.arange(max_len, device=device)
        tables = block_tables[sel].long()
        slots = tables[:, k_idx // block_size] * block_size + k_idx % block_size        # (S, L)
        q_start = torch.tensor([starts[i] for i in idx], device=device)
        q_len = torch.tensor([q_lens[i] for i in idx], device=device)
        j = torch.arange(max(q_lens[i] for i in idx), device=device)
        valid = j[None, :] < q_len[:, None]                                             # (S, Q)
        rows = torch.where(valid, q_start[:, None] + j[None, :], q_start[:, None])
        # Query j of a sequence sits at position seq_len - q_len + j and sees keys up to it.
        pos = (lens_ctx - q_len)[:, None] + j[None, :]                                  # (S, Q)
        mask = k_idx[None, None, :] <= pos[:, :, None]                                  # (S, Q, L)
        mask |= ~valid[:, :, None] & (k_idx == 0)                     # padding rows: no NaN
        plans.append(GroupPlan(slots, rows, valid, mask[:, None]))
    return plans


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    plan: list[GroupPlan] | None = None) -> torch.Tensor:
    """`plan` (from plan_attention) may be passed to reuse the index work across layers."""
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    out = torch.empty_like(q)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    # float32 stays float32; bf16/fp16 go to SDPA as they are (its CPU kernel accumulates in fp32).
    for g in plan:
        keys = flat_k[g.slots].transpose(1, 2)                                          # (S, Hkv, L, D)
        values = flat_v[g.slots].transpose(1, 2)
        queries = q[g.rows].transpose(1, 2)                                             # (S, H, Q, D)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale,
                                           enable_gqa=True)                             # (S, H, Q, D)
        out[g.rows[g.valid]] = o.transpose(1, 2)[g.valid]
    return out


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Causal attention of one sequence over contiguous K/V: q (T, H, D), k/v (L, Hkv, D), T <= L."""
    t, length = q.shape[0], k.shape[0]
    mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)
