"""Weight-only quantized layers for CPU inference with bfloat16 activations, and GGUF 4-bit decoding.

Contract:
- `Int4Linear(q, scale, zero, bias=None, group_size=32, input_repeats=1)`: q [N, K] in 0..15, scale/zero
  [N, K/G] (G = group_size in 32/64/128/256); the weight is
  `W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]`, the formula of torch's CPU int4
  kernel (checked against the kernel in tests/test_quant.py). Stored as
  `torch._convert_weight_to_int4pack_for_cpu(q)` (uint8 [N, K/2], a layout that depends on the
  CPU's ISA: never serialize it) and `scales_and_zeros` bfloat16 [K/G, N, 2].
  `forward(x [..., K]) -> [..., N]` runs `torch._weight_int4pack_mm_for_cpu` on bfloat16
  activations (other dtypes are cast in and out: with float32 activations the kernels take a path
  10-60x slower). Needs N % 16 == 0 and K % G == 0 (ValueError otherwise). input_repeats=r: the
  module takes K/r inputs and feeds them r times (the weight is the sum of its r column blocks).
- `Int8Linear(q, scale, bias=None)`: q [N, K] int8, scale [N] per output channel, W = q * scale[:,
  None]; forward by `torch._weight_int8pack_mm`. Its AVX-512 kernel reads 16 values per step with
  aligned loads: K = 8 returned NaN and K = 60 crashed the process (measured), so K % 16 != 0 is a
  ValueError and activations whose data pointer is not 64-byte aligned are copied first.
  All forwards trace under torch.compile (fullgraph, dynamic; worker/cpu_compile.py).
- `Int8Embedding(q [V, C] int8, scale [V])`: `forward(ids [T]) -> [T, C]` bfloat16 rows;
  `linear(x [S, C]) -> [S, V]` is the tied lm_head through the int8 kernel.
- `use_dequant_gemm(model, int4_min_rows, int8_min_rows)`: inputs of many rows run as bfloat16
  GEMMs on weights dequantized per call (worker/kernels/cpu_quant.py), not through the int4 / int8
  kernels; the model runner turns it on for CPU workers (`--int4-dequant-min-rows`, default 32;
  `--int8-dequant-min-rows`, default 8).
- `keep_dense_copies(model, min_rows)`: the opt-in hybrid (see there).
- Every module has `dequantize() -> float32 [N, K]`: the slow dense reference the tests compare
  the kernels with (Int4Linear recovers q from its packed bytes by probing the pack op's nibble
  order, so it holds for any CPU ISA). Optional `dense` copy (`keep_dense_copy`): a bfloat16 [N, K]
  weight used instead of the kernel for inputs of at least `dense_min_rows` rows (prefill, large
  batches); opt-in, 2 bytes per weight on top of the packed ones (docs/quantization.md).
- `quantize_int4(w, G)` (asymmetric min/max per group) and `quantize_int8(w)` (symmetric per row)
  round the scales to bfloat16 first and pick q against the rounded values.
- `decode_gguf_int4(raw [N, row_bytes] uint8, type) -> (q, scale, zero)` for Q4_0 (w = d(q-8):
  scale d, zero 0), Q4_1 (w = dq + m: scale d, zero m + 8d) and Q4_K (w = d*sc*q - dmin*m per
  32-value sub-block: scale d*sc, zero 8*d*sc - dmin*m): exact in float32; Int4Linear then rounds
  scale and zero to bfloat16 (|error| <= |q-8|*|scale|*2^-8 + |zero|*2^-8 per weight).
- `decode_gguf_q8_0_int4x2(raw)`: Q8_0 as two int4 halves (q = 16*hi + lo) for an Int4Linear
  with input_repeats=2 (x is fed twice, the halves' products add): Q8_0 executed exactly up to
  the bfloat16 rounding of d, at 1.25 bytes per weight (Q8_0 itself: 1.0625).
Proven by tests/test_quant.py (kernels vs dequantize, decoders vs gguf.quants.dequantize).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from worker.kernels import cpu_quant

INT4_GROUP_SIZES = (32, 64, 128, 256)
# GGUF types whose blocks map exactly onto Int4Linear's group-32 format.
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as a contiguous bfloat16 [M, K] matrix."""
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    return x2.contiguous()


@torch.library.custom_op("llm_quant::int8_mm", mutates_args=())
def _int8_mm_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch._weight_int8pack_mm on a 64-byte aligned copy of x when x is not aligned: opaque to
    torch.compile, which cannot look at data pointers."""
    if x.data_ptr() % 64:
        x = x.clone()
    return torch._weight_int8pack_mm(x, weight, scales)


@_int8_mm_op.register_fake
def _(x, weight, scales):
    return x.new_empty((x.shape[0], weight.shape[0]))


def int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ (weight [N, K] int8 * scales [N]).T -> [M, N] bf16. The AVX-512 kernel uses
    aligned loads: an input view whose data pointer is not 64-byte aligned is copied first (eager:
    checked here, no custom-op dispatch cost; compiled: inside the opaque custom op)."""
    if torch.compiler.is_compiling():
        return torch.ops.llm_quant.int8_mm(x, weight, scales)
    if x.data_ptr() % 64:
        x = x.clone()
    return torch._weight_int8pack_mm(x, weight, scales)


class _QuantLinearBase(nn.Module):
    in_features: int
    out_features: int

    def _init_bias_and_dense(self, bias: torch.Tensor | None) -> None:
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias: expected ({self.out_features},), got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).contiguous())
        self.dense: torch.Tensor | None = None  # opt-in bf16 copy (keep_dense_copy)
        self.dense_min_rows = 0
        self.dequant_min_rows = 0  # use_dequant_gemm: 0 = always the int4 / int8 kernel

    def keep_dense_copy(self, min_rows: int) -> None:
        """Keep a bfloat16 copy of the weight and use it (F.linear) for inputs of >= min_rows rows."""
        self.dense = self.dequantize().to(torch.bfloat16)
        self.dense_min_rows = int(min_rows)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 2
            and x.dtype is torch.bfloat16
            and x.shape[0]
            and self.dense is None
            and self._buffers["bias"] is None
            and x.is_contiguous()
        ):
            # The common case, straight to the kernel: a CPU decode step makes ~120 of these
            # calls, and the general path below cost ~4 us more each (~0.5 ms of a 6 ms step).
            return self._matmul(x)
        lead = x.shape[:-1]
        x2 = _rows(x, self.in_features)
        if x2.shape[0] == 0:
            out = x2.new_zeros((0, self.out_features))
        elif self.dense is not None and x2.shape[0] >= self.dense_min_rows:
            out = F.linear(x2, self.dense)
        else:
            out = self._matmul(x2)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def _int4_nibble_sources(n: int, k: int) -> torch.Tensor:
    """src[i] = flat index (row * k + col) of the value the pack op stores in nibble i of its
    output (nibble 2b: low half of byte b, 2b + 1: high half). Found by packing the base-16 digits
    of every index, so it holds for whatever layout this CPU's kernel uses."""
    idx = torch.arange(n * k, dtype=torch.int64)
    src = torch.zeros(n * k, dtype=torch.int64)
    shift = 0
    while (1 << shift) < n * k:
        digits = ((idx >> shift) & 15).to(torch.int32).view(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(digits, 1).reshape(-1)
        src |= _nibbles(packed).to(torch.int64) << shift
        shift += 4
    return src


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1)
    return torch.stack([flat & 15, flat >> 4], dim=-1).reshape(-1)


class Int4Linear(_QuantLinearBase):
    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = 32,
        input_repeats: int = 1,
    ):
        super().__init__()
        if q.dim() != 2:
            raise ValueError(f"q must be [N, K], got {tuple(q.shape)}")
        n, k = q.shape
        if input_repeats < 1 or k % input_repeats:
            raise ValueError(f"K={k} is not a multiple of input_repeats={input_repeats}")
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if n % 16 or k % group_size:
            raise ValueError(f"int4 weight [{n}, {k}]: needs N % 16 == 0 and K % {group_size} == 0")
        if scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(
                f"scale/zero must be [{n}, {k // group_size}], got {tuple(scale.shape)}, {tuple(zero.shape)}"
            )
        q = q.to(torch.int32)
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("int4 values must lie in 0..15")
        self.in_features, self.out_features, self.group_size = k // input_repeats, n, group_size
        self.input_repeats = input_repeats
        self.register_buffer("weight_packed", torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1)  # [K/G, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16).contiguous())
        self._init_bias_and_dense(bias)
        self.w4a8 = False  # to_w4a8: the weight in the VNNI op's layout, int8 activations

    @classmethod
    def from_float(
        cls, w: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> Int4Linear:
        return cls(*quantize_int4(w, group_size), bias=bias, group_size=group_size)

    def to_w4a8(self) -> bool:
        """Re-lay the weight out for cpu_quant.int4_vnni (int8 activations, VNNI dot products) and
        drop torch's packed copy; False (unchanged) for shapes the op does not take."""
        n, k = self.out_features, self.in_features
        if self.w4a8 or self.group_size != 32 or self.input_repeats != 1 or n % 64 or k % 32:
            return self.w4a8
        q = cpu_quant.int4_unpack(self.weight_packed, n, k)
        wq, sz = cpu_quant.int4_to_vnni(q, self.scales_and_zeros)
        self.register_buffer("vnni_weight", wq)
        self.register_buffer("vnni_sz", sz)
        self.weight_packed = self.scales_and_zeros = None
        self.w4a8, self.dequant_min_rows = True, 0
        return True

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        b = self._buffers  # (not nn.Module.__getattr__: this runs for every linear of every step)
        if self.w4a8:
            return cpu_quant.int4_vnni(x2, b["vnni_weight"], b["vnni_sz"])
        if self.dequant_min_rows and x2.shape[0] >= self.dequant_min_rows:
            w_t = cpu_quant.dequant_t(
                b["weight_packed"], b["scales_and_zeros"], self.group_size, self.input_repeats
            )
            return torch.mm(x2, w_t)
        if self.input_repeats > 1:
            x2 = torch.cat([x2] * self.input_repeats, dim=1)
        return torch._weight_int4pack_mm_for_cpu(
            x2, b["weight_packed"], self.group_size, b["scales_and_zeros"]
        )

    def unpacked(self) -> torch.Tensor:
        """The int4 values q [N, K * input_repeats] (uint8), recovered from the packed bytes (slow)."""
        if self.w4a8:
            return cpu_quant.int4_from_vnni(self.vnni_weight, self.vnni_sz)[0]
        n, k = self.out_features, self.in_features * self.input_repeats
        q = torch.empty(n * k, dtype=torch.uint8)
        q[_int4_nibble_sources(n, k)] = _nibbles(self.weight_packed)
        return q.view(n, k)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        if self.w4a8:
            sz = cpu_quant.int4_from_vnni(self.vnni_weight, self.vnni_sz)[1].float()  # [K/G, N, 2]
        else:
            sz = self.scales_and_zeros.float()
        scale = sz[..., 0].t().repeat_interleave(g, dim=1)  # [N, K]
        zero = sz[..., 1].t().repeat_interleave(g, dim=1)
        full = (self.unpacked().float() - 8) * scale + zero
        return sum(full.split(self.in_features, dim=1))  # the repeats' weights add

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", group_size={self.group_size}"
            + (f", input_repeats={self.input_repeats}" if self.input_repeats > 1 else "")
        )


class Int8Linear(_QuantLinearBase):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if q.dim() != 2 or q.dtype != torch.int8:
            raise ValueError(f"q must be an int8 [N, K] tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if k % 16:
            raise ValueError(f"int8 weight [{n}, {k}]: the int8 kernel needs K % 16 == 0")
        if scale.shape != (n,):
            raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scale.to(torch.bfloat16).contiguous())
        self._init_bias_and_dense(bias)
        self.w8a8 = False  # to_w8a8

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return cls(*quantize_int8(w), bias=bias)

    def to_w8a8(self) -> bool:
        return _to_w8a8(self)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if self.w8a8:
            return cpu_quant.int8_vnni(x2, b["vnni_weight"], b["vnni_corr"], b["scales"])
        if self.dequant_min_rows and x2.shape[0] >= self.dequant_min_rows:
            return cpu_quant.int8_linear(x2, b["weight"], b["scales"])
        return int8_mm(x2, b["weight"], b["scales"])

    def dequantize(self) -> torch.Tensor:
        return _int8_q(self).float() * self.scales.float()[:, None]


class Int8Embedding(nn.Module):
    """Token embedding held as int8 rows with one bfloat16 scale per row; doubles as the tied
    lm_head (`linear`), which reads every row each decode step: 1 byte per weight instead of 2."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if q.dim() != 2 or q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError(
                f"expected int8 [V, C] and scale [V], got {q.dtype} {tuple(q.shape)}, {tuple(scale.shape)}"
            )
        if q.shape[1] % 16:
            raise ValueError(f"embedding width {q.shape[1]}: the int8 kernel needs a multiple of 16")
        self.num_embeddings, self.embedding_dim = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scale.to(torch.bfloat16).contiguous())
        self.dense: torch.Tensor | None = None  # opt-in bf16 copy (keep_dense_copy)
        self.dense_min_rows = 0
        self.dequant_min_rows = 0  # use_dequant_gemm: 0 = always the int8 kernel
        self.w8a8 = False  # to_w8a8

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Embedding:
        return cls(*quantize_int8(w))

    def keep_dense_copy(self, min_rows: int) -> None:
        """Keep a bfloat16 copy (the same values as the int8 rows give) for the lm_head on inputs
        of >= min_rows rows, where the int8 kernel loses to F.linear."""
        self.dense = self.dequantize().to(torch.bfloat16)
        self.dense_min_rows = int(min_rows)

    def to_w8a8(self) -> bool:
        return _to_w8a8(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_quant.int8_rows_from_vnni(self.vnni_weight, ids) if self.w8a8 else self.weight[ids]
        return rows.to(torch.bfloat16) * self.scales[ids].unsqueeze(-1)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] -> [..., V] (bfloat16): the tied lm_head."""
        x2 = _rows(x, self.embedding_dim)
        if self.dense is not None and x2.shape[0] >= self.dense_min_rows:
            out = F.linear(x2, self.dense)
        elif self.w8a8:
            out = cpu_quant.int8_vnni(x2, self.vnni_weight, self.vnni_corr, self.scales)
        elif self.dequant_min_rows and x2.shape[0] >= self.dequant_min_rows:
            out = cpu_quant.int8_linear(x2, self.weight, self.scales)
        else:
            out = int8_mm(x2, self.weight, self.scales)
        return out.reshape(*x.shape[:-1], self.num_embeddings)

    def dequantize(self) -> torch.Tensor:
        return _int8_q(self).float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per row" + (", w8a8" if self.w8a8 else "")


def _to_w8a8(module: Int8Linear | Int8Embedding) -> bool:
    """Re-lay an int8 [N, K] weight out for cpu_quant.int8_vnni (int8 activations, VNNI) and drop
    the row-major copy; False (unchanged) for shapes the op does not take (N % 16, K % 32)."""
    n, k = module.weight.shape if not module.w8a8 else (0, 0)
    if module.w8a8 or n % 16 or k % 32:
        return module.w8a8
    wq, corr = cpu_quant.int8_to_vnni(module.weight)
    module.register_buffer("vnni_weight", wq)
    module.register_buffer("vnni_corr", corr)
    module.weight = None
    module.w8a8, module.dequant_min_rows = True, 0
    return True


def _int8_q(module: Int8Linear | Int8Embedding) -> torch.Tensor:
    """The int8 weight [N, K], from whichever layout the module holds."""
    return cpu_quant.int8_from_vnni(module.vnni_weight) if module.w8a8 else module.weight


def use_int8_activations(model: nn.Module) -> int:
    """Every int4 / int8 module of `model` whose shape the VNNI ops take multiplies int8-quantized
    activations (per row and group of 32, llama.cpp's Q8 scheme) with AVX512-VNNI dot products
    (worker/kernels/cpu_quant.py: 2-3x the int4 kernel's speed, 2.7-5x the int8 kernel's); the
    weights are re-laid out in place, no copy kept. Returns the number of modules converted (0
    when the CPU or the build has no VNNI)."""
    if not cpu_quant.vnni_available():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            count += module.to_w4a8()
        elif isinstance(module, (Int8Linear, Int8Embedding)):
            count += module.to_w8a8()
    return count


def use_dequant_gemm(
    model: nn.Module,
    int4_min_rows: int = cpu_quant.INT4_MIN_ROWS,
    int8_min_rows: int = cpu_quant.INT8_MIN_ROWS,
) -> int:
    """Inputs of many rows skip the weight-only kernels, which re-read the weight every 1 (int8)
    or 4 (int4) rows: every Int4Linear whose shape the op takes runs inputs of >= int4_min_rows
    rows as one dequantization of its weight to a temporary bfloat16 matrix plus one GEMM, and
    every Int8Linear / Int8Embedding lm_head runs inputs of >= int8_min_rows rows as bfloat16
    GEMMs over tiles of dequantized rows (worker/kernels/cpu_quant.py has the numbers; no resident
    copy). 0 turns a kind off. Returns the number of modules that take it (0 when the op is
    unavailable)."""
    if not (int4_min_rows or int8_min_rows) or not cpu_quant.available():
        return 0
    count = 0
    for module in model.modules():
        if getattr(module, "w4a8", False) or getattr(module, "w8a8", False):
            continue  # the VNNI ops take every row count
        if isinstance(module, Int4Linear) and int4_min_rows and cpu_quant.supports(module.out_features):
            module.dequant_min_rows = int(int4_min_rows)
        elif isinstance(module, (Int8Linear, Int8Embedding)) and int8_min_rows:
            module.dequant_min_rows = int(int8_min_rows)
        else:
            continue
        count += 1
    return count


def keep_dense_copies(model: nn.Module, min_rows: int = 16) -> int:
    """Opt-in hybrid: every Int4Linear/Int8Linear/Int8Embedding of `model` also keeps a bfloat16
    copy of its weight and runs inputs of >= min_rows rows (prefill chunks, large decode batches,
    the lm_head of many sequences) through F.linear on it, where the weight-only kernels (a GEMV
    per 4 rows) lose: on 2 threads, all SmolLM2 linears at 512 rows took 821 ms as int4 vs 78 ms
    as bfloat16 (Xeon with AMX), and the crossover is between 8 and 16 rows there and on this
    repo's EPYC (docs/quantization.md). Costs 2 bytes per weight on top of the quantized ones
    (+257 MiB for SmolLM2: ~3.9x the GGUF file in all). Returns the bytes added.
    Note: a torch.compile'd step that skips guard evaluation keeps whichever branch it traced."""
    added = 0
    for module in model.modules():
        if isinstance(module, (_QuantLinearBase, Int8Embedding)):
            module.keep_dense_copy(min_rows)
            added += module.dense.numel() * module.dense.element_size()
    return added


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


# --- GGUF 4-bit blocks -------------------------------------------------------------------------


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
