"""Attention backends: the one seam between the model and the kernels.

Contract: `AttentionMetadata` is built once per step by the model runner and shared by all layers:
- `slot_mapping [num_tokens] int64`: cache slot of each new token (block_id * block_size + offset).
- `block_tables [num_seqs, max_blocks] int32`: physical block ids of each sequence, padded with 0.
- `seq_lens [num_seqs] int32`: tokens in context after this step (cached + new).
- `query_start_loc [num_seqs + 1] int32`: offsets of each sequence's new tokens in the flat batch.
- `max_query_len`, `max_seq_len`: host-side ints, so kernels need no device sync.
A backend offers `store_kv` and `paged_attention` with the signatures of worker/kernels/reference.py,
and optionally `fused`: a namespace with `rms_norm(x, weight, eps, residual=None)`,
`rotary_embedding(positions, q, k, cos, sin)` and `silu_and_mul(x)` (worker/kernels/triton_norm.py)
that the model then uses instead of its torch RMSNorm, residual add, RoPE and MLP activation
("triton": 3-10x faster per call on an H200, docs/kernels.md; "cpu" with bfloat16 / float16
activations: the C++ ops of worker/kernels/cpu_fused.py), and optionally
`rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> q_rotated`
(worker/kernels/triton_rope_kv.py; "cpu" with bfloat16 / float16: worker/kernels/cpu_fused.py):
RoPE on q and k and the cache write in one call, which the model then calls through
`rope_store_forward` instead of RoPE + `forward`.
"cpu" is a batched C++ op (worker/kernels/cpu_attention.py, built on first use: the CPU default
when it builds, else "auto" falls back to "torch" with one warning naming why);
"torch" is plain torch (worker/kernels/torch_attention.py: runs anywhere);
"reference" is the slow float32 oracle of worker/kernels/reference.py; "triton" runs the Triton
kernels (CUDA, or CPU under TRITON_INTERPRET=1 for tests). Proven by tests/test_kernels.py,
tests/test_torch_attention.py, tests/test_cpu_attention.py and the engine-vs-HF tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prepared: object = None  # backend-specific per-step index work, built by the first layer


class AttentionBackend:
    def __init__(
        self,
        name: str,
        store_kv,
        paged_attention,
        takes_max_lens: bool,
        prepare=None,
        fused=None,
        rope_store_kv=None,
    ):
        self.name = name
        self.fused = fused
        self.rope_store_kv = rope_store_kv
        self.store_kv = store_kv
        self.paged_attention = paged_attention
        self.takes_max_lens = takes_max_lens
        self.prepare = prepare

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write the new k/v (T, Hkv, D) into the cache, then attend q (T, H, D) over it. A KV cache
        of another dtype than the activations (--kv-cache-dtype) gets q cast to it, and the output
        cast back; except an fp8 cache under triton, whose kernel widens the K/V tiles to q's dtype."""
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def rope_store_forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`forward` for un-rotated q/k: RoPE (cos/sin [P, D/2] gathered at `positions`) and the
        cache write in one `rope_store_kv` launch, then attention. Only when `rope_store_kv` is set;
        the rotated k lives only in the cache (nothing after the write reads k)."""
        q = self.rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dtype != k_cache.dtype and not (k_cache.dtype == torch.float8_e4m3fn and self.name == "triton"):
            return self.forward_q(q.to(k_cache.dtype), k_cache, v_cache, meta, scale).to(q.dtype)
        return self.forward_q(q, k_cache, v_cache, meta, scale)

    def forward_q(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        extra = (
            dict(max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
            if self.takes_max_lens
            else {}
        )
        if self.prepare is not None:
            if meta.prepared is None:
                meta.prepared = self.prepare(
                    meta.block_tables, meta.seq_lens, meta.query_start_loc, k_cache.shape[1]
                )
            extra["plan"] = meta.prepared
        return self.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, **extra
        )


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """`dtype`: the model's activation dtype; "cpu" fuses the small ops for bfloat16 / float16 (float32
    stays the plain-torch reference path)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else _auto_cpu_backend()
    if name == "cpu":
        from worker.kernels import cpu_attention, cpu_ext, cpu_fused, reference

        cpu_ext.load()  # RuntimeError naming why, if it cannot build
        fused = dtype in (torch.bfloat16, torch.float16)
        return AttentionBackend(
            "cpu",
            reference.store_kv,
            cpu_attention.paged_attention,
            False,
            fused=cpu_fused if fused else None,
            rope_store_kv=cpu_fused.rope_store_kv if fused else None,
        )
    if name == "torch":
        from worker.kernels import reference, torch_attention

        return AttentionBackend(
            "torch",
            reference.store_kv,
            torch_attention.paged_attention,
            False,
            torch_attention.plan_attention,
        )
    if name == "reference":
        from worker.kernels import reference

        return AttentionBackend("reference", reference.store_kv, reference.paged_attention, False)
    if name == "triton":
        from worker.kernels import triton_attention, triton_norm, triton_rope_kv, triton_store_kv

        return AttentionBackend(
            "triton",
            triton_store_kv.store_kv,
            triton_attention.paged_attention,
            True,
            fused=triton_norm,
            rope_store_kv=triton_rope_kv.rope_store_kv,
        )
    raise ValueError(f"unknown attention backend {name!r} (expected auto, cpu, torch, reference or triton)")


def _auto_cpu_backend() -> str:
    """ "cpu" (the C++ op of worker/kernels/cpu_attention.py) when it builds, else "torch"."""
    from worker.kernels import cpu_ext

    if cpu_ext.available():
        return "cpu"
    logging.getLogger(__name__).warning(
        "attention backend auto: using torch, %s", cpu_ext.unavailable_reason()
    )
    return "torch"
