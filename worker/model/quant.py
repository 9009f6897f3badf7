"""Quantized layers for CPU inference: int4 / int8 weights, bfloat16 (or int8: VNNI, AVX2) activations.

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
- The CPU execution paths a model runner picks per module (int8 activations, dequantize-then-GEMM
  for many rows, dense copies): worker/model/cpu_paths.py.
- Every module has `dequantize() -> float32 [N, K]`: the slow dense reference the tests compare
  the kernels with (Int4Linear recovers q from its packed bytes by probing the pack op's nibble
  order, so it holds for any CPU ISA). Optional `dense` copy (`keep_dense_copy`): a bfloat16 [N, K]
  weight used instead of the kernel for inputs of at least `dense_min_rows` rows (prefill, large
  batches); opt-in, 2 bytes per weight on top of the packed ones (docs/quantization.md).
- The reference quantizers and the GGUF block decoders: worker/model/gguf_quant.py.
Proven by tests/test_quant.py (kernels vs dequantize).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from worker.kernels import cpu_quant
from worker.model.gguf_quant import quantize_int4, quantize_int8

INT4_GROUP_SIZES = (32, 64, 128, 256)


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


class QuantLinearBase(nn.Module):
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


class Int4Linear(QuantLinearBase):
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
        drop torch's packed copy; False (unchanged) for shapes the op does not take, or where the
        CPU or the build has neither VNNI nor AVX2 int8 dot products."""
        n, k = self.out_features, self.in_features
        if self.w4a8 or self.group_size != 32 or self.input_repeats != 1 or n % 64 or k % 32:
            return self.w4a8
        if not cpu_quant.vnni_available():
            return False
        block = cpu_quant.unpack_block()  # torch's AVX-512 (64) or AVX2 (32) layout: views, no map
        q = cpu_quant.int4_unpack(self.weight_packed, n, k, block) if block else self.unpacked()
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


class Int8Linear(QuantLinearBase):
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
        if self.w8a8:  # one op call: the fancy-indexed gather took ~4% of a served decode step
            return cpu_quant.int8_vnni_embedding(self.vnni_weight, self.scales, ids)
        return self.weight[ids].to(torch.bfloat16) * self.scales[ids].unsqueeze(-1)

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
    the row-major copy; False (unchanged) for shapes the op does not take (N % 16, K % 32) or
    where the CPU or the build has no int8 dot products (AVX512-VNNI or AVX2)."""
    n, k = module.weight.shape if not module.w8a8 else (0, 0)
    if module.w8a8 or n % 16 or k % 32 or not cpu_quant.vnni_available():
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
