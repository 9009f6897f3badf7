"""Our CPU ops for the quantized linears (worker/kernels/cpu_quant.cpp, in the llm_cpu extension of
worker/kernels/cpu_ext.py): dequantize-then-GEMM for many-row inputs, and int8 activations with
AVX512-VNNI or AVX2.

Why: torch's weight-only kernels are GEMVs. The int4 one (`_weight_int4pack_mm_for_cpu`)
re-reads and re-dequantizes the whole weight for every 4 rows of input, the int8 one for every
row, so a 256-token prefill chunk makes ~64 passes over each int4 weight, and the tied lm_head
(49,152 x 576 int8) of a 32-sequence decode step 32. Two remedies:
- many rows, bfloat16 activations: one dequantization pass into a temporary bfloat16 matrix (int4:
  the whole weight; int8: 1024-row tiles, each inside one parallel task) and oneDNN's bfloat16
  GEMM: most of the bfloat16 speed with no resident copy (`--dense-weights-min-rows` keeps one: +2
  bytes per weight). Below ~32 rows (int4) / 8-16 rows (int8) torch's kernels win, so the modules
  take this path from `INT4_MIN_ROWS` (32) / `INT8_MIN_ROWS` (16) rows (`--int4-dequant-min-rows`,
  `--int8-dequant-min-rows`).
- any rows, VNNI CPUs (the default there): activations quantized to int8 per row and 32-value
  group (d = max|x| / 127, llama.cpp's Q8 scheme) and multiplied with the int4 (W4A8) or int8
  (W8A8) weights by `vpdpbusd` dot products, int32 sums scaled per group in float32. Faster than
  both torch kernels at every row count; the logit error grows (docs/quantization.md). On AVX2
  CPUs without AVX-512 (the default there too) the same ops and layouts run on 256-bit registers
  with `vpmaddubsw` + `vpmaddwd`, llama.cpp's AVX2 dot products: the same integer sums.
Timings (ms, both threads of a 2-vCPU EPYC, Zen 5; docs/quantization.md "Faster CPU paths" has
the sweep): all 120 SmolLM2 int4 linears at 1 / 8 / 32 / 256 rows, torch's int4 kernel 3.4 / 7.0
/ 23.5 / 174, W4A8 2.7 / 4.4 / 11.6 / 63, dequantize + GEMM 18 / 22 / 27 / 78; the lm_head, torch's
int8 kernel 1.06 / 2.3 / 8.1 / 59, W8A8 0.85 / 0.99 / 2.6 / 12, tiled bfloat16 2.5 / 3.2 / 4.6 / 18.

Contract:
- `available() -> bool`: the extension loads and this CPU's torch packs int4 weights in the layout
  the ops read (probed once; torch's AVX-512 layout: per block of 64 rows, K runs of 32 bytes,
  byte j = rows j and 32 + j). False on other layouts (the caller keeps torch's kernels).
- `supports(n) -> bool`: N % 64 == 0 (the dequantization op's block).
- `dequant_t(weight_packed uint8 [N, K/2], scales_and_zeros bf16 [K/G, N, 2], G, repeats)
  -> bf16 [K/repeats, N]`: the transposed weight, `x @ dequant_t(...)` is the layer's output;
  the repeats' column blocks summed in float32 and rounded once (Int4Linear's input_repeats).
- `int8_linear(x bf16 [M, K], q int8 [N, K], scale [N]) -> bf16 [M, N]`: x @ (q * scale).T over
  dequantized `INT8_TILE`-row tiles.
- `vnni_available() -> bool`: the extension loads and was compiled with int8 dot products
  (AVX512-VNNI or AVX2; "vnni" names the layouts); `int8_dots_isa()` says which ("" if none). The
  W4A8 conversion reads torch's int4 weights with `int4_unpack` in the row block `unpack_block()`
  found (64: torch's AVX-512 layout, 32: its AVX2 one), else through Int4Linear's probed map.
- `int4_vnni(x bf16 [M, K], wq uint8 [N/16, K/8, 16, 4], sz bf16 [N/16, K/32, 2, 16]) -> bf16
  [M, N]` and `int8_vnni(x, wq int8 [N/16, K/4, 16, 4], corr int32 [N/16, K/32, 16], scale [N])`:
  the W4A8 / W8A8 products with x rounded as `round_activations(x)` (the float32 reference);
  `int4_to_vnni` / `int8_to_vnni` build those layouts from (q, scales_and_zeros) / q, and
  `int4_from_vnni` / `int8_from_vnni` / `int8_rows_from_vnni` invert them exactly;
  `int8_vnni_embedding(wq, scale, ids [...]) -> bf16 [..., K]` is the int8 embedding's lookup
  straight from the W8A8 layout (rows times their scales, as torch rounds them).
- Every op has a fake (meta) kernel (registered by worker/kernels/cpu_ext.py when the library
  loads), so the compiled CPU step traces through them.
Fails how: the ops' checks raise ValueError / RuntimeError (shapes, dtypes, N % 16 or 64, K % 32,
a W4A8 / W8A8 op in a build with neither AVX512-VNNI nor AVX2).
Proven by tests/test_cpu_quant.py (each op against its float32 reference, the layouts' round
trips, the layout probe, the modules on both sides of the thresholds, the engine's greedy tokens)
and tests/test_quant_smollm.py (SmolLM2 through each path against float32).
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_ext

# Inputs with at least this many rows take the dequantize-then-GEMM paths by default on CPU
# (the crossovers measured in the module docstring).
INT4_MIN_ROWS = 32
INT8_MIN_ROWS = 16
BLOCK_N = 64
# Rows of an int8 weight dequantized per tile (1024 x 576 bf16: 1.2 MiB, about one core's L2).
INT8_TILE = 1024

_layout: dict[str, bool] = {}


def _layout_matches(block: int = BLOCK_N) -> bool:
    """Pack a 128 x 64 matrix whose values name their own (row, column) and check the bytes
    against the block-`block` layout: per block of `block` rows, K runs of block / 2 bytes, byte j
    = rows j (low nibble) and block / 2 + j (high). torch's AVX-512 kernel packs with 64, its AVX2
    one with 32."""
    n, k = 2 * BLOCK_N, 64
    rows = torch.arange(n, dtype=torch.int32)[:, None].expand(n, k)
    cols = torch.arange(k, dtype=torch.int32)[None, :].expand(n, k)
    q = ((rows * 7 + cols * 3) % 16).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed.shape == (n, k // 2) and torch.equal(packed, _pack_blocks(q, block))


def _pack_blocks(q: torch.Tensor, block: int) -> torch.Tensor:
    """q [N, K] (0..15) in the block-`block` layout, [N, K / 2] uint8 (the inverse of int4_unpack)."""
    n, k = q.shape
    half = block // 2
    blocks = q.to(torch.uint8).view(n // block, block, k).permute(0, 2, 1)  # [B, K, block]
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(n, k // 2)


def unpack_block() -> int | None:
    """The row block of torch's int4 layout on this CPU (64 or 32), None for any other layout
    (callers then unpack through Int4Linear's probed nibble map)."""
    if "block" not in _layout:
        _layout["block"] = next((b for b in (BLOCK_N, 32) if _layout_matches(b)), None)
    return _layout["block"]


def available() -> bool:
    if "ok" not in _layout:
        ok = cpu_ext.available() and unpack_block() == BLOCK_N
        if ok:
            cpu_ext.ops()
        _layout["ok"] = ok
    return _layout["ok"]


def supports(n: int) -> bool:
    return n % BLOCK_N == 0


def dequant_t(weight_packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, repeats: int):
    return cpu_ext.ops().int4_dequant_t(weight_packed, scales_and_zeros, group_size, repeats)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cpu_ext.ops().int8_linear_tiled(x, q, scale, INT8_TILE)


# ---- W4A8 / W8A8 with AVX512-VNNI or AVX2 (int8 activations) ------------------------------


def vnni_available() -> bool:
    """The W4A8 / W8A8 ops run here: the extension loads and has int8 dot products (AVX512-VNNI
    or AVX2), whatever torch's int4 layout."""
    if "vnni" not in _layout:
        _layout["vnni"] = cpu_ext.available() and bool(cpu_ext.ops().vnni_compiled())
    return _layout["vnni"]


def int8_dots_isa() -> str:
    """The int8 dot products compiled in: "AVX512-VNNI", "AVX2", or "" (none)."""
    return str(cpu_ext.ops().int8_dots_isa()) if vnni_available() else ""


def int4_unpack(weight_packed: torch.Tensor, n: int, k: int, block: int = BLOCK_N) -> torch.Tensor:
    """torch's packed int4 in the block-`block` layout (`unpack_block()`) -> q uint8 [N, K]."""
    p = weight_packed.view(n // block, k, block // 2)
    q = torch.cat([p & 15, p >> 4], dim=2)  # [N/block, K, block]: rows j and block/2 + j of each block
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
    """Rows `ids` [...] of int8_from_vnni(wq), without unpacking the rest: [..., K] int8."""
    return wq[ids // 16, :, ids % 16, :].reshape(*ids.shape, -1)


def int8_vnni_embedding(wq: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of the W8A8 layout times their scales: bf16 [..., K], bit-identical to
    `int8_rows_from_vnni(wq, ids).to(bf16) * scale[ids].unsqueeze(-1)` (one op call, no unpacking)."""
    out = cpu_ext.ops().int8_vnni_embedding(wq, scale, ids.reshape(-1).long())
    return out.view(*ids.shape, out.shape[-1])


def int4_vnni(x: torch.Tensor, wq: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return cpu_ext.ops().int4_vnni_linear(x, wq, sz)


def int8_vnni(x: torch.Tensor, wq: torch.Tensor, corr: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cpu_ext.ops().int8_vnni_linear(x, wq, corr, scale)


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ops' activation quantization in torch, value for value: x [M, K] -> (q float32 [M, K/32,
    32] = x * (127 / max|x|) rounded half to even, d [M, K/32] = max|x| / 127, sums [M, K/32] of q)
    per row and group of 32, in float32 with a true division (`127 / t` in torch multiplies by a
    reciprocal: 1 ulp off in about a quarter of the groups). A group with a NaN or inf: q = 0,
    sum 0, d = NaN; an all-zero group: all 0; a group whose 127 / max|x| overflows (max|x| below
    ~3.7e-37): q = 0, sum 0, d = max|x| / 127."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    amax = g.abs().amax(-1)
    finite = torch.isfinite(g).all(-1)
    inv = torch.where(finite & (amax > 0), torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    inv = torch.where(inv.isinf(), torch.zeros_like(inv), inv)  # amax < ~3.7e-37: a zero group
    q = torch.where(finite[..., None], torch.round(g * inv[..., None]), torch.zeros_like(g))
    d = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    return q, d, q.sum(-1)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """The reference of the ops' rounded activations: x [M, K] -> float32 [M, K], each value its
    int8 code times its group's scale (quantize_reference)."""
    q, d, _ = quantize_reference(x)
    return (q * d[..., None]).view(x.shape)
