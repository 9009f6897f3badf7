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
- Sampling: `sampling_logits(logits [S, V], temperature [S], min_p, top_k, top_p)`: / temperature,
  then min-p (`apply_min_p`: drop tokens with probability below min_p x the row's largest), then
  top-k and top-p (`apply_top_k_top_p`: the k largest, then the smallest set whose mass reaches
  top_p; top_k 0 = off); a step passed None is skipped. The math of worker/sampling_ops.py's
  batched sampler (which decides the steps from the rows' SamplingParams) and of the fused
  kernel's reference (worker/kernels/triton_sampling.py `reference_fused_sample`).
- Fails how: shape or dtype mismatch raises ValueError before any work.
- This is the slow, obviously-right oracle (one sequence at a time, float32). The CPU backend runs
  the faster plain-torch path of worker/kernels/torch_attention.py, tested against this.
- Proven by: tests/test_kernels.py (Triton vs this), tests/test_torch_attention.py (CPU fast path
  vs this) and tests/test_engine_hf.py (engine logits vs transformers); the sampling steps by
  tests/test_sampler.py (against worker/sampler_reference.py) and tests/test_triton_sampling.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"head layout mismatch: q heads {num_heads}x{head_dim}, "
            f"kv heads {num_kv_heads}x{k_cache.shape[3]}"
        )
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"batch mismatch: seq_lens {num_seqs}, query_start_loc "
            f"{query_start_loc.shape[0]}, block_tables {block_tables.shape[0]}"
        )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"store_kv shapes: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"cache {tuple(k_cache.shape)}"
        )
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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The oracle: gather each sequence's blocks into contiguous K/V, attend in float32."""
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # (L, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        out[starts[i] : starts[i + 1]] = contiguous_attention(q[starts[i] : starts[i + 1]], k, v, scale)
    return out


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence over contiguous K/V: q (T, H, D), k/v (L, Hkv, D), T <= L."""
    t, length = q.shape[0], k.shape[0]
    mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float()[None],
        k.transpose(0, 1).float()[None],
        v.transpose(0, 1).float()[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # (1, H, T, D)
    return out[0].transpose(0, 1).to(q.dtype)


# ---- Sampling: the truncations of worker/sampling_ops.py, the oracle of triton_sampling.py --------


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's top-k and top-p sets. top_k 0 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Keep a token when the mass before it is still below top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's largest probability."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def sampling_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits the random draw uses: / temperature [S], then min-p, then top-k and top-p (both
    given or neither). A step given None is skipped for every row (its caller knows no row uses it)."""
    out = logits / temperature[:, None]
    if min_p is not None:
        out = apply_min_p(out, min_p)
    if top_k is not None:
        out = apply_top_k_top_p(out, top_k, top_p)
    return out
