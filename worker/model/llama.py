"""Llama-family decoder in one readable file (SmolLM2, Llama 2/3, Qwen2-style q/k/v bias).

Contract: `forward(input_ids [T] int64, positions [T] int64, kv_caches, meta) -> hidden [T, C]`
over a *flat* batch: the new tokens of every scheduled sequence back to back (no padding, no batch
dimension). `compute_logits(hidden [S, C]) -> [S, vocab] float32`, called only on the rows that
sample. State: none besides the weights; the paged KV cache is passed in (one (K, V) pair per
layer) and written through the attention backend. Weights use Hugging Face names at load time
(`load_hf_state_dict`) and are fused here (q|k|v, gate|up) so each projection is one matmul.
The loader may swap the linear layers for weight-only int4/int8 modules and the embedding (the
tied lm_head) for an int8 one (worker/model/quant.py); they take and return bfloat16.
Tensor parallel (worker/tp): a rank's model is this one built from its shard's config (heads and
intermediate size divided by the TP size), with `all_reduce` set on every Attention and MLP: the
sum of the row-parallel o_proj / down_proj partial outputs, one collective each.
Proven by tests/test_engine_hf.py: logits match transformers' LlamaForCausalLM (rel. err. <= 1e-4);
the quantized forms by tests/test_quant_gguf.py and tests/test_quant_smollm.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from worker.attention import AttentionBackend, AttentionMetadata
from worker.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None or scaling.factor == 1.0:
        return inv_freq.float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    out = torch.where(wavelen < high_wavelen, inv_freq, out)
    return out.float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self.args = (head_dim, max_position, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if not self.cos.is_meta:
            self.reset()

    def reset(self) -> None:
        head_dim, max_position, theta, scaling = self.args
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(self.cos.device)  # (P, D/2)
        self.sin = freqs.sin().to(self.sin.device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each token's position, (T, 1, D/2); computed once per step."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_sin
        x1, x2 = x.float().chunk(2, dim=-1)  # (T, H, D/2)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.scale = cfg.head_dim**-0.5
        self.all_reduce = None  # tensor parallel (worker/tp): sums the row-parallel o_proj partials

    def forward(
        self,
        x: torch.Tensor,
        rope_in,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """`rope_in`: the step's (cos, sin) tables, or its positions when the backend fuses RoPE."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if backend.fused is not None and backend.rope_store_kv is not None:
            # RoPE on q and k and the K/V cache write in one launch (triton_rope_kv).
            out = backend.rope_store_forward(
                rope_in, q, k, v, self.rope.cos, self.rope.sin, kv_cache[0], kv_cache[1], meta, self.scale
            )
        else:
            if backend.fused is not None:
                q, k = backend.fused.rotary_embedding(rope_in, q, k, self.rope.cos, self.rope.sin)
            else:
                q, k = self.rope.apply(rope_in, q), self.rope.apply(rope_in, k)
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = self.o_proj(out.reshape(-1, self.q_size))  # (T, C)
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.all_reduce = None  # tensor parallel (worker/tp): sums the row-parallel down_proj partials

    def forward(self, x: torch.Tensor, silu_and_mul=None) -> torch.Tensor:
        """`silu_and_mul`: the fused kernel ([T, 2F] -> [T, F]) of the backend, if it has one."""
        gate_up = self.gate_up_proj(x)  # (T, 2F)
        if silu_and_mul is None:
            gate, up = gate_up.chunk(2, dim=-1)  # (T, F) each
            h = F.silu(gate) * up
        else:
            h = silu_and_mul(gate_up)
        out = self.down_proj(h)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope_in, kv_cache, meta, backend):
        """Returns (x, residual). The torch path adds the residual itself (residual stays None);
        with fused kernels the sum is carried to the next norm, which adds it (one kernel)."""
        fused = backend.fused
        if fused is None:
            x = x + self.self_attn(self.input_layernorm(x), rope_in, kv_cache, meta, backend)
            return x + self.mlp(self.post_attention_layernorm(x)), None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = fused.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = fused.rms_norm(x, norm1.weight, norm1.eps, residual)  # norm(x + residual)
        h = self.self_attn(h, rope_in, kv_cache, meta, backend)
        h, residual = fused.rms_norm(h, norm2.weight, norm2.eps, residual)
        return self.mlp(h, fused.silu_and_mul), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # On the meta device (the loader's build) the random init is skipped: nn.Embedding's normal_ on
        # a meta tensor runs through torch._refs, which imports torch._dynamo and triton (~1 s of a
        # worker's start, and nanobind's page of leak warnings at its exit) for weights then replaced.
        meta = torch.get_default_device().type == "meta"
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if meta else None)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        rows = cfg.lm_head_rows or cfg.vocab_size  # a tensor-parallel rank holds only its vocab rows
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, C)
        rope = self.layers[0].self_attn.rope
        rope_in = positions if backend.fused is not None else rope.tables(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope_in, kv_cache, meta, backend)
        if residual is None:
            return self.norm(x)
        return backend.fused.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    def reset_rope(self) -> None:
        self.layers[0].self_attn.rope.reset()

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the norms'): bfloat16 when the weights are int4/int8 modules."""
        return self.norm.weight.dtype

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(S, V) logits, float32 unless `upcast=False` (the model dtype: a greedy argmax needs no copy)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)  # (S, V)
        elif isinstance(self.embed_tokens, nn.Embedding):
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.embed_tokens.linear(hidden)  # Int8Embedding
        return logits.float() if upcast else logits

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors ("model.layers.0.self_attn.q_proj.weight", ...)."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights.items():
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                self._copy_shard(params[key], tensor, target, shard)
                loaded.add(f"{key}#{shard}")
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}"
                    )
                params[name].copy_(tensor)
                loaded.add(name)
        expected = set()
        for name in params:
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        missing = expected - loaded
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:5]} ({len(missing)} in all)")

    def _copy_shard(self, param: torch.Tensor, tensor: torch.Tensor, target: str, shard: int) -> None:
        cfg = self.config
        if target == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            offset, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:
            offset, size = shard * cfg.intermediate_size, cfg.intermediate_size
        dst = param.narrow(0, offset, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"{target}[{shard}]: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}")
        dst.copy_(tensor)
