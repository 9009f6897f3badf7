"""Weight-only quantization kernels and GGUF decoding (worker/model/quant.py, worker/model/gguf_quant.py).

- Kernels vs their `dequantize()` references: Int4Linear (group 32, incl. a partial 64-row block
  and the Q8_0 two-halves form), Int8Linear (incl. a misaligned input), Int8Embedding, the opt-in
  dense copy; shape limits fail with ValueError before any kernel runs.
- GGUF decoding vs gguf.quants.dequantize: Q4_0, Q4_1 (from gguf's own quantizer), Q4_K (random
  blocks), Q8_0 as two int4 halves.
The loader's quantized forms: tests/test_quant_gguf.py (a synthetic GGUF, safetensors quantized at
load) and tests/test_quant_smollm.py (the embedded SmolLM2).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.quant_helpers import (
    BF16_U,
    Q,
    bf16_out_tol,
    one_thread,  # noqa: F401 - autouse: one intra-op thread in this module
    q4_k_blocks,
)
from worker.model.cpu_paths import keep_dense_copies
from worker.model.gguf_quant import decode_gguf_int4, decode_gguf_q8_0_int4x2, quantize_int4, quantize_int8
from worker.model.quant import Int4Linear, Int8Embedding, Int8Linear

# --- kernels vs dequantize() ---------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(96, 128), (192, 576), (64, 1536), (16, 32)])
def test_int4_linear_matches_its_dequantized_weight(n, k):
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen)
    m = Int4Linear(q, scale, zero, bias=bias)
    assert torch.equal(m.unpacked(), q)  # the pack op's nibble order, inverted
    w = m.dequantize()
    sb, zb = (t.to(torch.bfloat16).float().repeat_interleave(32, 1) for t in (scale, zero))
    assert torch.equal(w, (q.float() - 8) * sb + zb)  # the documented formula, exactly
    for rows in (1, 3, 5, 17):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ref = x.float() @ w.T + bias.to(torch.bfloat16).float()
        out = m(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        assert float((out.float() - ref).abs().max()) <= bf16_out_tol(ref)
    x3 = torch.randn(2, 3, k, generator=gen)  # float32, leading dims: cast in and out
    out3 = m(x3)
    assert out3.dtype == torch.float32 and out3.shape == (2, 3, n)
    torch.testing.assert_close(out3, m(x3.to(torch.bfloat16)).float().reshape(2, 3, n))


def test_int8_linear_matches_its_dequantized_weight_even_for_misaligned_inputs():
    gen = torch.Generator().manual_seed(1)
    for n, k in [(7, 64), (64, 576), (130, 1536)]:
        m = Int8Linear.from_float(torch.randn(n, k, generator=gen) * 0.05)
        w = m.dequantize()
        for rows in (1, 4, 9):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            ref = x.float() @ w.T
            assert float((m(x).float() - ref).abs().max()) <= bf16_out_tol(ref)
            # the AVX-512 kernel uses aligned loads: a view 2 bytes off must still work
            buf = torch.empty(rows * k + 1, dtype=torch.bfloat16)
            shifted = buf[1:].view(rows, k)
            shifted.copy_(x)
            assert shifted.data_ptr() % 64
            torch.testing.assert_close(m(shifted), m(x), rtol=0, atol=0)


def test_int8_embedding_lookup_and_lm_head():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 64, generator=gen) * 0.1
    emb = Int8Embedding.from_float(w)
    deq = emb.dequantize()
    ids = torch.tensor([0, 5, 299, 5])
    assert torch.equal(emb(ids), deq[ids].to(torch.bfloat16))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    ref = x.float() @ deq.T
    assert float((emb.linear(x).float() - ref).abs().max()) <= bf16_out_tol(ref)


def test_dense_copy_is_used_from_its_row_threshold():
    gen = torch.Generator().manual_seed(3)
    m = Int4Linear.from_float(torch.randn(64, 128, generator=gen) * 0.05)
    x_small = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    x_big = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    kernel_small, kernel_big = m(x_small), m(x_big)
    m.keep_dense_copy(min_rows=8)
    assert m.dense.dtype == torch.bfloat16 and m.dense.shape == (64, 128)
    assert torch.equal(m(x_small), kernel_small)  # below the threshold: the kernel
    assert torch.equal(m(x_big), nn.functional.linear(x_big, m.dense))
    ref = x_big.float() @ m.dequantize().T  # and both agree with the reference
    assert float((m(x_big).float() - ref).abs().max()) <= 2 * bf16_out_tol(ref)
    assert float((kernel_big.float() - ref).abs().max()) <= bf16_out_tol(ref)
    emb = Int8Embedding.from_float(torch.randn(100, 128, generator=gen))
    model = nn.Sequential(
        Int4Linear.from_float(torch.randn(64, 128, generator=gen)),
        Int8Linear.from_float(torch.randn(32, 64, generator=gen)),
        emb,
    )
    head_small, head_big = emb.linear(x_small), emb.linear(x_big)
    assert keep_dense_copies(model, min_rows=4) == (64 * 128 + 32 * 64 + 100 * 128) * 2
    assert all(m.dense_min_rows == 4 for m in model)
    assert torch.equal(emb.linear(x_small[:2]), head_small[:2])
    assert torch.equal(emb.linear(x_big), nn.functional.linear(x_big, emb.dense))
    head_ref = head_big.float()
    assert float((emb.linear(x_big).float() - head_ref).abs().max()) <= 2 * bf16_out_tol(head_ref)


def test_modules_trace_under_torch_compile_and_match_eager():
    """worker/cpu_compile.py compiles each decoder layer with fullgraph=True and dynamic shapes:
    the quantized modules must trace (no data-pointer checks in traced code) and agree."""
    gen = torch.Generator().manual_seed(8)
    a = Int4Linear.from_float(
        torch.randn(128, 64, generator=gen) * 0.05, bias=torch.randn(128, generator=gen)
    )
    b = Int8Linear.from_float(torch.randn(64, 128, generator=gen) * 0.05)
    e = Int8Embedding.from_float(torch.randn(100, 64, generator=gen))

    def step(ids, x):
        return e.linear(b(nn.functional.silu(a(e(ids) + x))))

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (3, 7, 2):  # one graph for every size
            ids = torch.randint(0, 100, (rows,), generator=gen)
            x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
            ref = step(ids, x)
            # measured: at most one bfloat16 ulp of the output apart (inductor fuses the
            # elementwise ops in float32)
            err = float((compiled(ids, x).float() - ref.float()).abs().max())
            assert err <= 2 * bf16_out_tol(ref.float())


def test_shape_limits_fail_before_any_kernel_runs():
    with pytest.raises(ValueError, match="N % 16"):
        Int4Linear(torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 2), torch.zeros(40, 2))
    with pytest.raises(ValueError, match="K % 32"):
        Int4Linear(torch.zeros(32, 48, dtype=torch.uint8), torch.ones(32, 1), torch.zeros(32, 1))
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="K % 16"):  # K = 60 crashed the process (measured)
        Int8Linear(torch.zeros(8, 60, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Embedding(torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))


def test_quantizers_stay_within_half_a_step():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen)
    w[3] = 0.25  # a constant row: zero range
    q, scale, zero = quantize_int4(w)
    deq = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    bound = (0.5 * scale + BF16_U * (zero.abs() + 8 * scale)).repeat_interleave(32, 1) + 1e-7
    assert bool(((deq - w).abs() <= bound).all())
    assert torch.equal(deq[3], torch.full((256,), 0.25))
    q8, s8 = quantize_int8(w)
    err = (q8.float() * s8[:, None] - w).abs()
    assert bool((err <= 0.5 * s8[:, None] + BF16_U * w.abs().amax(1, keepdim=True) + 1e-7).all())


# --- GGUF decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_blocks_decode_like_gguf(qtype):
    w = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32) * 0.05
    w[0, :32] += 0.5  # an all-positive block (Q4_1: m > 0)
    raw = gguf.quants.quantize(w, Q[qtype])
    ref = gguf.quants.dequantize(raw, Q[qtype])
    q, scale, zero = decode_gguf_int4(raw, qtype)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    deq = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    np.testing.assert_allclose(deq.numpy(), ref, rtol=1e-6, atol=1e-7)
    _check_int4_module_against(Int4Linear(q, scale, zero), ref, scale, zero)


def test_q4_k_blocks_decode_like_gguf():
    raw = q4_k_blocks(32, 512, 6)
    ref = gguf.quants.dequantize(raw, Q.Q4_K)
    q, scale, zero = decode_gguf_int4(raw, "Q4_K")
    deq = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    np.testing.assert_allclose(deq.numpy(), ref, rtol=1e-6, atol=1e-7)
    _check_int4_module_against(Int4Linear(q, scale, zero), ref, scale, zero)


def test_q8_0_as_two_int4_halves_is_exact_up_to_bf16_scales():
    w = np.random.default_rng(7).standard_normal((48, 256)).astype(np.float32) * 0.05
    w[1, :32] = np.linspace(-1, 1, 32)  # q = -127 and 127 in one block
    raw = gguf.quants.quantize(w, Q.Q8_0)
    ref = gguf.quants.dequantize(raw, Q.Q8_0)
    q4, scale, zero = decode_gguf_q8_0_int4x2(raw)
    assert q4.shape == (48, 512) and int(q4.max()) <= 15
    full = (q4.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    np.testing.assert_allclose((full[:, :256] + full[:, 256:]).numpy(), ref, rtol=1e-6, atol=1e-7)
    m = Int4Linear(q4, scale, zero, input_repeats=2)
    assert m.in_features == 256
    w_bf = m.dequantize().numpy()  # = bf16(d) * q: relative error <= 2^-8
    assert np.all(np.abs(w_bf - ref) <= np.abs(ref) * BF16_U * 1.0001)
    x = torch.randn(5, 256).to(torch.bfloat16)
    out_ref = x.float() @ torch.from_numpy(w_bf).T
    assert float((m(x).float() - out_ref).abs().max()) <= bf16_out_tol(out_ref)


def _check_int4_module_against(m: Int4Linear, ref: np.ndarray, scale, zero) -> None:
    """The module's weight = the GGUF values up to the bfloat16 rounding of scale and zero."""
    w = m.dequantize().numpy()
    q = m.unpacked().float().numpy()
    bound = (
        np.abs(q - 8) * np.repeat(np.abs(scale.numpy()), 32, 1) + np.repeat(np.abs(zero.numpy()), 32, 1)
    ) * BF16_U
    assert np.all(np.abs(w - ref) <= bound * 1.0001 + 1e-9)
    x = torch.randn(4, m.in_features).to(torch.bfloat16)
    out_ref = x.float() @ torch.from_numpy(w).T
    assert float((m(x).float() - out_ref).abs().max()) <= bf16_out_tol(out_ref)
