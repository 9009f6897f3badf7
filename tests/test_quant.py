"""Weight-only quantization (worker/model/quant.py) and the loader's quantized forms (worker/model/loader.py).

- Kernels vs their `dequantize()` references: Int4Linear (group 32, incl. a partial 64-row block
  and the Q8_0 two-halves form), Int8Linear (incl. a misaligned input), Int8Embedding, the opt-in
  dense copy; shape limits fail with ValueError before any kernel runs.
- GGUF decoding vs gguf.quants.dequantize: Q4_0, Q4_1 (from gguf's own quantizer), Q4_K (random
  blocks), Q8_0 as two int4 halves; the header walk vs gguf.GGUFReader.
- A synthetic tiny llama GGUF with every supported family (Q4_0/Q4_1/Q4_K fused into one int4
  q|k|v, Q8_0, F16, F32, Q6_K): each quantized module's weight equals the float32 load's within
  bfloat16 rounding of the scales (proves the Q/K row un-permutation on blocks and the fusion),
  logits close, an IQ2_XXS tensor fails naming itself; CUDA dequantizes (when there is a GPU).
- The embedded SmolLM2: int4 linears + int8 embedding, weights <= 1.3x the file (tensor bytes,
  and RSS in a fresh process), logits and teacher-forced greedy agreement vs the float32 model
  within margins of the measured values, and the engine serving it end to end.
- Tiny safetensors checkpoints quantized at load (int8, int4).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn

from worker.model.checkpoint import read_gguf_tensor_infos
from worker.model.loader import load_model
from worker.model.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    decode_gguf_int4,
    decode_gguf_q8_0_int4x2,
    keep_dense_copies,
    quantize_int4,
    quantize_int8,
)

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as tests/conftest.py's runner uses: on these shared 2-vCPU machines
    OpenMP fork/join under CPU steal made two threads several times slower (measured here too:
    the float32 reference's greedy setup took 126 s on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BF16_U = 2.0**-8  # bfloat16 unit roundoff (8-bit significand)


def bf16_out_tol(ref: torch.Tensor) -> float:
    """A kernel's bfloat16 output rounding plus fp32 accumulation-order noise."""
    return float(ref.abs().max()) * 2 * BF16_U + 1e-3


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


def _q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K rows (gguf has no Q4_K quantizer): random 6-bit scales/mins and nibbles, small
    float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((rows, cols // 256, 1)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = (rng.random((rows, cols // 256, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_q4_k_blocks_decode_like_gguf():
    raw = _q4_k_blocks(32, 512, 6)
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


# --- a synthetic llama GGUF ----------------------------------------------------------------------

TINY = dict(vocab=96, hidden=256, ffn=256, layers=2, heads=4, kv_heads=2)
MIXED_TYPES = {  # every family the loader handles, and a q|k|v fused from three 4-bit types
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.attn_v.weight": "Q4_K",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "F16",
    "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q4_1",
    "blk.1.ffn_gate.weight": "Q4_K",
    "blk.1.ffn_up.weight": "Q4_0",
    "blk.1.ffn_down.weight": "F32",
    "token_embd.weight": "Q8_0",
}


def _raw_tensor(qtype: str, rows: int, cols: int, rng) -> tuple[np.ndarray, Q | None]:
    if qtype in ("F32", "F16"):
        dtype = np.float32 if qtype == "F32" else np.float16
        return (rng.standard_normal((rows, cols)) * 0.05).astype(dtype), None
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(w, Q[qtype]), Q[qtype]
    if qtype == "Q4_K":
        return _q4_k_blocks(rows, cols, int(rng.integers(1 << 30))), Q.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]  # Q6_K, IQ2_XXS: random blocks
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == "Q6_K":  # int8 sub-scales in -8..8, d ~ 1e-3
        raw[..., 192:208] = rng.integers(-8, 9, (rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        d = (rng.random((rows, cols // block, 1)) * 1e-3 + 1e-4).astype(np.float16)
        raw[..., 208:210] = d.view(np.uint8)
    return raw.reshape(rows, -1), Q[qtype]


def write_tiny_gguf(path, types: dict[str, str], seed: int = 0):
    c = TINY
    head_dim = c["hidden"] // c["heads"]
    shapes = {"token_embd.weight": (c["vocab"], c["hidden"]), "output_norm.weight": (c["hidden"],)}
    for i in range(c["layers"]):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (c["hidden"],),
                f"blk.{i}.ffn_norm.weight": (c["hidden"],),
                f"blk.{i}.attn_q.weight": (c["hidden"], c["hidden"]),
                f"blk.{i}.attn_k.weight": (c["kv_heads"] * head_dim, c["hidden"]),
                f"blk.{i}.attn_v.weight": (c["kv_heads"] * head_dim, c["hidden"]),
                f"blk.{i}.attn_output.weight": (c["hidden"], c["hidden"]),
                f"blk.{i}.ffn_gate.weight": (c["ffn"], c["hidden"]),
                f"blk.{i}.ffn_up.weight": (c["ffn"], c["hidden"]),
                f"blk.{i}.ffn_down.weight": (c["hidden"], c["ffn"]),
            }
        )
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c["vocab"])
    w.add_eos_token_id(2)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data, raw_dtype = _raw_tensor(types.get(name, "Q4_1"), *shape, rng)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED_TYPES)


def test_header_walk_matches_gguf_reader(mixed_gguf):
    reader = gguf.GGUFReader(str(mixed_gguf))
    ours = {t.name: t for t in read_gguf_tensor_infos(mixed_gguf)}
    blob = mixed_gguf.read_bytes()
    assert set(ours) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        info = ours[t.name]
        assert info.type_name == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert blob[info.offset : info.offset + info.nbytes] == t.data.tobytes()


def _forward_logits(model, ids: list[int]) -> torch.Tensor:
    from benchmarks.quant_accuracy import Runner

    return Runner(model, len(ids), 1).score([ids[:1]], [ids[1:] + [0]])[0]


def test_mixed_gguf_quantized_modules_equal_the_float32_weights(mixed_gguf):
    ref = load_model(mixed_gguf, "float32", "cpu", quantization="auto").model  # float32: all dense
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in ref.modules())
    quant = load_model(mixed_gguf, "bfloat16", "cpu", quantization="auto").model
    l0, l1 = quant.layers[0], quant.layers[1]
    expect = {
        l0.self_attn.qkv_proj: Int4Linear,
        l0.self_attn.o_proj: Int4Linear,
        l0.mlp.gate_up_proj: nn.Linear,
        l0.mlp.down_proj: Int8Linear,
        l1.self_attn.qkv_proj: Int4Linear,
        l1.self_attn.o_proj: Int4Linear,
        l1.mlp.gate_up_proj: Int4Linear,
        l1.mlp.down_proj: nn.Linear,
        quant.embed_tokens: Int8Embedding,
    }
    for module, cls in expect.items():
        assert type(module) is cls
    assert l0.self_attn.o_proj.input_repeats == 2 and l1.self_attn.qkv_proj.input_repeats == 2  # Q8_0
    assert l0.mlp.gate_up_proj.weight.dtype == torch.bfloat16
    ref_mods = dict(ref.named_modules())
    for name, module in quant.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear, Int8Embedding)):
            w_ref = ref_mods[name].weight.detach()
            w = module.dequantize()
            if isinstance(module, Int4Linear):  # exact blocks: only the bf16 scale/zero rounding
                bound = 2 * BF16_U * w_ref.abs().amax(1, keepdim=True)  # measured 1.0x BF16_U
            else:  # int8 rows: half a step + bf16 scale rounding
                bound = (0.5 / 127 + BF16_U) * w_ref.abs().amax(1, keepdim=True)
            assert bool(((w - w_ref).abs() <= bound + 1e-6).all()), name
    ids = [1, 17, 42, 5, 77, 3, 9, 60, 31, 2, 88, 12]
    out, out_ref = _forward_logits(quant, ids), _forward_logits(ref, ids)
    rel = float((out - out_ref).abs().max() / out_ref.abs().max())
    assert rel <= 0.05, rel  # measured 0.016 (dense bfloat16 of the same file: 0.009)


def test_unsupported_tensor_type_fails_naming_the_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "iq.gguf", {**MIXED_TYPES, "blk.1.ffn_up.weight": "IQ2_XXS"})
    for dtype, quantization in [("bfloat16", "auto"), ("float32", "none")]:
        with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*IQ2_XXS"):
            load_model(path, dtype, "cpu", quantization=quantization)


def test_quantization_none_and_explicit_modes_on_gguf(mixed_gguf):
    dense = load_model(mixed_gguf, "bfloat16", "cpu", quantization="none").model
    assert all(type(m) is not Int4Linear for m in dense.modules())
    assert dense.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    int8 = load_model(mixed_gguf, "bfloat16", "cpu", quantization="int8").model
    assert type(int8.layers[0].self_attn.qkv_proj) is Int4Linear  # stored 4-bit stays 4-bit
    assert type(int8.layers[0].mlp.gate_up_proj) is Int8Linear  # F16 quantized
    assert type(int8.layers[1].self_attn.qkv_proj) is Int8Linear  # Q8_0 requantized per channel
    int4 = load_model(mixed_gguf, "bfloat16", "cpu", quantization="int4").model
    for layer in int4.layers:
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = layer.get_submodule(path)
            assert type(module) is Int4Linear and module.input_repeats == 1


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: checks that quantized GGUF tensors are dequantized there",
)
def test_cuda_dequantizes_quantized_tensors(mixed_gguf):
    cuda = load_model(mixed_gguf, "bfloat16", "cuda", quantization="auto").model
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in cuda.modules())
    assert cuda.layers[0].self_attn.qkv_proj.weight.device.type == "cuda"
    ref = load_model(mixed_gguf, "float32", "cpu", quantization="none").model
    torch.testing.assert_close(
        cuda.layers[1].mlp.down_proj.weight.float().cpu(),
        ref.layers[1].mlp.down_proj.weight.detach().to(torch.bfloat16).float(),
    )


# --- the embedded SmolLM2 ------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why 1 is not prime.",
]


@pytest.fixture(scope="module")
def smollm_quant():
    return load_model(None, "bfloat16", "cpu", quantization="auto")


def test_smollm2_weights_stay_in_stored_precision(smollm_quant):
    from common.model_files import default_model_path

    model = smollm_quant.model
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("Int4Linear") == 120 and kinds.count("Int8Embedding") == 1  # 210 Q4_1 tensors fused
    assert "Linear" not in kinds and model.lm_head is None and model.dtype == torch.bfloat16
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes <= 1.3 * default_model_path().stat().st_size  # measured 0.985x


def test_smollm2_load_resident_memory_in_a_fresh_process():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.quant_accuracy",
            "--measure-load",
            "bfloat16",
            "auto",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    m = json.loads(out.stdout.splitlines()[-1])
    # measured: resident 107-109 MiB, peak 125-129 MiB for a 93.8 MiB file (the old loader: 1,074 MiB peak)
    assert m["resident_mib"] <= 1.3 * m["file_mib"], m
    assert m["peak_mib"] <= 1.7 * m["file_mib"], m


@pytest.fixture(scope="module")
def smollm_float32():
    """The float32 reference on CPU (the shared `runner` fixture is on CUDA where there is one)."""
    return load_model(None, "float32", "cpu", quantization="none").model


@pytest.fixture(scope="module")
def smollm_reference(smollm_float32, tokenizer):
    """The float32 model's greedy continuations (32 tokens) of PROMPTS."""
    from benchmarks.quant_accuracy import Runner

    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = Runner(smollm_float32, max(map(len, prompts)) + 32, len(prompts))
    outputs = ref.greedy(prompts, 32)
    return prompts, outputs, ref.score(prompts, outputs)


def test_smollm2_quantized_logits_and_greedy_agree_with_float32(smollm_quant, smollm_reference):
    from benchmarks.quant_accuracy import Runner, compare

    prompts, ref_tokens, ref_logits = smollm_reference
    runner = Runner(smollm_quant.model, max(map(len, prompts)) + 32, len(prompts))
    res = compare(ref_logits, ref_tokens, runner.score(prompts, ref_tokens), runner.greedy(prompts, 32))
    # measured on these 96 positions: max abs 1.26, mean abs 0.165, max rel 0.033, top-1 99.0%
    # (benchmarks/quant_accuracy.py, 20 prompts x 64 tokens: 1.91, 0.141, 0.051, 97.6%)
    assert res["logits_max_abs"] <= 3.0, res
    assert res["logits_mean_abs"] <= 0.35, res
    assert res["logits_max_rel"] <= 0.07, res
    assert res["teacher_forced_top1_agreement"] >= 0.9, res


def test_engine_serves_the_quantized_model(smollm_float32, smollm_reference):
    """Quantization through EngineConfig: the engine's own logits (chunked prefill, paged decode)
    match the float32 model's on the engine's own tokens."""
    from benchmarks.quant_accuracy import Runner
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="bfloat16",
            quantization="auto",
            kv_cache_bytes=64 * 2**20,
            attention_backend="torch",
            num_threads=1,
            max_num_batched_tokens=7,
        )
    )
    assert sum(isinstance(m, Int4Linear) for m in engine.runner.model.modules()) == 120
    captured: dict[str, list[torch.Tensor]] = {}
    engine.runner.logits_observer = lambda rids, logits: [
        captured.setdefault(r, []).append(row.clone()) for r, row in zip(rids, logits)
    ]
    prompts = smollm_reference[0]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ours = [torch.stack(captured[r]) for r in sorted(captured)]
    ref = Runner(smollm_float32, max(map(len, prompts)) + 8, len(prompts)).score(prompts, outputs)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        assert float((o - r).abs().max() / r.abs().max()) <= 0.07  # measured 0.027-0.036
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# --- dense safetensors checkpoints quantized at load ---------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_safetensors_quantized_at_load(tmp_path, quantization):
    from tests.test_engine_tiny import save_tiny

    path, hf = save_tiny(tmp_path, "llama3")  # untied lm_head
    ref = load_model(path, "float32", "cpu").model
    auto = load_model(path, "bfloat16", "cpu", quantization="auto").model
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in auto.modules())
    quant = load_model(path, "bfloat16", "cpu", quantization=quantization).model
    cls = Int8Linear if quantization == "int8" else Int4Linear
    assert type(quant.layers[0].self_attn.qkv_proj) is cls and type(quant.layers[1].mlp.down_proj) is cls
    assert type(quant.embed_tokens) is Int8Embedding and type(quant.lm_head) is Int8Linear
    ref_mods = dict(ref.named_modules())
    for name, module in quant.named_modules():
        if isinstance(module, cls):
            w_ref = ref_mods[name].weight.detach()
            err = (module.dequantize() - w_ref).abs().max() / w_ref.abs().max()
            assert float(err) <= (0.005 if quantization == "int8" else 0.1), name  # measured 0.0039, 0.064
    ids = [5, 9, 17, 33, 2, 8, 100, 41, 7, 3]
    out, out_ref = _forward_logits(quant, ids), _forward_logits(ref, ids)
    rel = float((out - out_ref).abs().max() / out_ref.abs().max())
    # measured 0.015 (int8) and 0.13 (int4: a random tiny model has no slack; dense bfloat16: 0.006)
    assert rel <= (0.05 if quantization == "int8" else 0.25), rel
