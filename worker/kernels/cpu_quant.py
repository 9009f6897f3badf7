"""Int4 weights for many-row inputs on CPU: dequantize the packed weight once per call
(worker/kernels/cpu_quant.cpp, in the llm_cpu extension) and run one bfloat16 GEMM.

Why: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) re-reads and re-dequantizes the whole
weight for every 4 rows of input, so a 256-token prefill chunk costs ~64 passes over every weight:
measured 2.5-3.4x slower than a bfloat16 GEMM on the same matrix. One dequantization pass into a
temporary bfloat16 matrix (0.11 ms for a 1536 x 576 weight on a 2-core EPYC) then oneDNN's GEMM
gives most of the bfloat16 speed with no resident copy (`--dense-weights-min-rows` keeps one: +2
bytes per weight). Below ~32 rows the int4 kernel wins (it reads 4x fewer bytes), so Int4Linear
takes this path only for inputs of at least `min_rows` rows (`--int4-dequant-min-rows`,
docs/cpu-serving.md has the crossover).

Contract:
- `available() -> bool`: the extension loads and this CPU's torch packs int4 weights in the layout
  the op reads (probed once; torch's AVX-512 layout: per block of 64 rows, K runs of 32 bytes,
  byte j = rows j and 32 + j). False on other layouts (the caller keeps torch's kernel).
- `supports(n) -> bool`: N % 64 == 0 (the op's block).
- `dequant_t(weight_packed uint8 [N, K/2], scales_and_zeros bf16 [K/G, N, 2], G, repeats)
  -> bf16 [K/repeats, N]`: the transposed weight, `x @ dequant_t(...)` is the layer's output;
  the repeats' column blocks summed in float32 and rounded once (Int4Linear's input_repeats).
Fails how: the op's checks raise ValueError (N % 64, K/repeats % G, dtypes, shapes).
Proven by tests/test_cpu_quant.py (the op against Int4Linear.dequantize, the layout probe, the
layer's outputs on both sides of the threshold, the engine's greedy tokens with and without).
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_attention

# Inputs with at least this many rows take the dequantize-then-GEMM paths by default on CPU
# (the crossovers measured in the module docstring).
INT4_MIN_ROWS = 32
INT8_MIN_ROWS = 8
BLOCK_N = 64
# Rows of an int8 weight dequantized per tile (1024 x 576 bf16: 1.2 MiB, about one core's L2).
INT8_TILE = 1024

_layout: dict[str, bool] = {}


def _ops():
    if "path" not in cpu_attention._state:
        cpu_attention.load()
    return torch.ops.llm_cpu


def _layout_matches() -> bool:
    """Pack a 128 x 64 matrix whose values name their own (row, column) and check the bytes."""
    n, k = 2 * BLOCK_N, 64
    rows = torch.arange(n, dtype=torch.int32)[:, None].expand(n, k)
    cols = torch.arange(k, dtype=torch.int32)[None, :].expand(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(((rows * 7 + cols * 3) % 16).contiguous(), 1)
    q = ((rows * 7 + cols * 3) % 16).to(torch.uint8)
    # expected[b, k, j] = q[64b + j, k] | q[64b + 32 + j, k] << 4
    blocks = q.view(n // BLOCK_N, BLOCK_N, k).permute(0, 2, 1)  # [B, K, 64]
    expected = blocks[..., :32] | (blocks[..., 32:] << 4)
    return packed.shape == (n, k // 2) and torch.equal(packed.reshape(-1), expected.reshape(-1))


def available() -> bool:
    if "ok" not in _layout:
        ok = cpu_attention.available() and _layout_matches()
        if ok:
            _ops()
        _layout["ok"] = ok
    return _layout["ok"]


def supports(n: int) -> bool:
    return n % BLOCK_N == 0


def dequant_t(weight_packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, repeats: int):
    return _ops().int4_dequant_t(weight_packed, scales_and_zeros, group_size, repeats)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _ops().int8_linear_tiled(x, q, scale, INT8_TILE)


# ---- W4A8 / W8A8 with AVX512-VNNI (int8 activations) ----------------------------------------


def vnni_available() -> bool:
    """The op was compiled with AVX512-VNNI and torch's int4 layout is the one unpacked here."""
    if "vnni" not in _layout:
        _layout["vnni"] = available() and bool(_ops().vnni_compiled())
    return _layout["vnni"]


def int4_unpack(weight_packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """torch's packed int4 (the block-64 layout `available()` checked) -> q uint8 [N, K]."""
    p = weight_packed.view(n // BLOCK_N, k, 32)
    q = torch.cat([p & 15, p >> 4], dim=2)  # [N/64, K, 64]: rows j and 32 + j of each block
    return q.permute(0, 2, 1).reshape(n, k)


def int4_to_vnni(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (0..15), scales_and_zeros bf16 [K/32, N, 2] -> the op's (wq uint8 [N/16,
    K/8, 16, 4], sz bf16 [N/16, K/32, 2, 16]); N % 16 == 0, K % 32 == 0."""
    n, k = q.shape
    halves = q.view(n // 16, 16, k // 8, 2, 4)  # [block, row, run of 8, low/high half, j]
    wq = (halves[:, :, :, 0, :] | (halves[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    sz = scales_and_zeros.view(k // 32, n // 16, 16, 2).permute(1, 0, 3, 2).contiguous()
    return wq, sz


def int4_from_vnni(wq: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of int4_to_vnni: (q uint8 [N, K], scales_and_zeros bf16 [K/32, N, 2])."""
    blocks, runs = wq.shape[:2]
    n, k = blocks * 16, runs * 8
    halves = torch.stack([wq & 15, wq >> 4], dim=3)  # [block, run, row, half, j]
    q = halves.permute(0, 2, 1, 3, 4).reshape(n, k)
    return q, sz.permute(1, 0, 3, 2).reshape(k // 32, n, 2)


def int8_to_vnni(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] -> the op's (wq int8 [N/16, K/4, 16, 4], corr int32 [N/16, K/32, 16] =
    128 * each row's sum over each group of 32 columns); N % 16 == 0, K % 32 == 0."""
    n, k = q.shape
    wq = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    sums = q.view(n // 16, 16, k // 32, 32).to(torch.int32).sum(-1, dtype=torch.int32)
    return wq, (128 * sums).permute(0, 2, 1).contiguous()


def int8_from_vnni(wq: torch.Tensor) -> torch.Tensor:
    blocks, runs = wq.shape[:2]
    return wq.permute(0, 2, 1, 3).reshape(blocks * 16, runs * 4)


def int8_rows_from_vnni(wq: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of int8_from_vnni(wq), without unpacking the rest: [T, K] int8."""
    return wq[ids // 16, :, ids % 16, :].reshape(ids.shape[0], -1)


def int4_vnni(x: torch.Tensor, wq: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return _ops().int4_vnni_linear(x, wq, sz)


def int8_vnni(x: torch.Tensor, wq: torch.Tensor, corr: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _ops().int8_vnni_linear(x, wq, corr, scale)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """The reference of the ops' activation quantization: x [M, K] -> float32 [M, K] rounded to
    int8 per row and group of 32 (d = max|x| / 127, round half to even), dequantized."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).view(m, k)


def register_fakes() -> None:
    """Meta implementation (shape and dtype only), called once when the extension loads."""

    @torch.library.register_fake("llm_cpu::int4_dequant_t")
    def _(packed, scales_and_zeros, group_size, repeats):
        return packed.new_empty((packed.shape[1] * 2 // repeats, packed.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake("llm_cpu::int8_linear_tiled")
    def _(x, q, scale, tile):
        return x.new_empty((x.shape[0], q.shape[0]))

    @torch.library.register_fake("llm_cpu::int4_vnni_linear")
    def _(x, wq, sz):
        return x.new_empty((x.shape[0], wq.shape[0] * 16))

    @torch.library.register_fake("llm_cpu::int8_vnni_linear")
    def _(x, wq, corr, scale):
        return x.new_empty((x.shape[0], wq.shape[0] * 16))
