"""Reference int4 / int8 quantizers and the GGUF block decoders behind worker/model/quant.py's layers.

Contract:
- `quantize_int4(w, G)` (asymmetric min/max per group) and `quantize_int8(w)` (symmetric per row)
  round the scales to bfloat16 first and pick q against the rounded values.
- `decode_gguf_int4(raw [N, row_bytes] uint8, type) -> (q, scale, zero)` for Q4_0 (w = d(q-8):
  scale d, zero 0), Q4_1 (w = dq + m: scale d, zero m + 8d) and Q4_K (w = d*sc*q - dmin*m per
  32-value sub-block: scale d*sc, zero 8*d*sc - dmin*m): exact in float32; Int4Linear then rounds
  scale and zero to bfloat16 (|error| <= |q-8|*|scale|*2^-8 + |zero|*2^-8 per weight).
- `decode_gguf_q8_0_int4x2(raw)`: Q8_0 as two int4 halves (q = 16*hi + lo) for an Int4Linear
  with input_repeats=2 (x is fed twice, the halves' products add): Q8_0 executed exactly up to
  the bfloat16 rounding of d, at 1.25 bytes per weight (Q8_0 itself: 1.0625).
Proven by tests/test_quant.py (decoders vs gguf.quants.dequantize, quantizers vs their formulas).
"""

from __future__ import annotations

import numpy as np
import torch

# GGUF types whose blocks map exactly onto Int4Linear's group-32 format.
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max group-wise int4 of w [N, K]: (q uint8 [N, K], scale, zero [N, K/G]) with
    scale and zero already bfloat16-representable and q the nearest level given them."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = torch.round((g - zero[..., None]) * inv[..., None] + 8).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, zero


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of w [N, K]: (q int8 [N, K], scale [N]); scale = max|row| / 127
    rounded to bfloat16 (0 for an all-zero row)."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).to(torch.bfloat16).float()
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 from a [..., 2] uint8 array, as float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def decode_gguf_int4(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q4_K rows (raw [N, row_bytes] uint8) -> (q uint8 [N, K], scale, zero
    float32 [N, K/32]) with w = (q - 8) * scale + zero, exact in float32. numpy on purpose: one
    thread, no OpenMP barrier per small op (those cost ~20 ms each on a CPU-starved 2-vCPU VM)."""
    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = raw.reshape(n, -1, head + 16)  # [N, K/32, bytes]
        d = _f16(blocks[..., 0:2])
        qs = blocks[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # byte j: values j, j+16
        zero = np.zeros_like(d) if type_name == "Q4_0" else _f16(blocks[..., 2:4]) + 8 * d
        return torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(zero)
    if type_name == "Q4_K":
        blocks = raw.reshape(n, -1, 144)  # 256 values per block
        nb = blocks.shape[1]
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc_bytes = blocks[..., 4:16].reshape(n, nb, 3, 4)
        a, b, c = sc_bytes[..., 0, :], sc_bytes[..., 1, :], sc_bytes[..., 2, :]
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=-1).astype(np.float32)  # 6-bit
        mn = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=-1).astype(np.float32)
        qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32)  # chunk c: sub-blocks 2c, 2c+1
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nb * 256)
        scale = (d[..., None] * sc).reshape(n, nb * 8)
        zero = 8 * scale - (dmin[..., None] * mn).reshape(n, nb * 8)
        return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero)
    raise ValueError(f"{type_name} is not a 4-bit GGUF type this decoder handles ({GGUF_INT4_TYPES})")


def decode_gguf_q8_0_int4x2(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows (raw [N, row_bytes] uint8; w = d * q, q int8 per 32-value block) as two int4
    halves for an Int4Linear with input_repeats=2: q = 16 * hi + lo with lo = q mod 16 in 0..15 and
    hi in -8..7, so w = (hi + 8 - 8) * 16d + 0  +  (lo - 8) * d + 8d. Returns (q4 uint8 [N, 2K] =
    [hi + 8 | lo], scale [N, 2K/32] = [16d | d], zero = [0 | 8d]): exact in float32, and after
    Int4Linear's bfloat16 rounding w = bf16(d) * q (16d and 8d are d times powers of two)."""
    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = _f16(blocks[..., 0:2])  # [N, K/32]
    q = blocks[..., 2:].view(np.int8).astype(np.int16)  # [N, K/32, 32]
    lo = (q & 15).astype(np.uint8)
    hi = ((q >> 4) + 8).astype(np.uint8)  # >> 4: floor(q / 16)
    q4 = np.concatenate([hi.reshape(n, -1), lo.reshape(n, -1)], axis=1)
    scale = np.concatenate([16 * d, d], axis=1)
    zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
    return torch.from_numpy(q4), torch.from_numpy(scale), torch.from_numpy(zero)
