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


def register_fakes() -> None:
    """Meta implementation (shape and dtype only), called once when the extension loads."""

    @torch.library.register_fake("llm_cpu::int4_dequant_t")
    def _(packed, scales_and_zeros, group_size, repeats):
        return packed.new_empty((packed.shape[1] * 2 // repeats, packed.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake("llm_cpu::int8_linear_tiled")
    def _(x, q, scale, tile):
        return x.new_empty((x.shape[0], q.shape[0]))
