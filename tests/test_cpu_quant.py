"""The many-row paths of the quantized CPU layers (worker/kernels/cpu_quant.py): the int4
dequantization op and the tiled int8 linear against the slow float32 references, the layers
switching at their row thresholds, the layout probe, bad arguments, and the engine serving the
embedded SmolLM2 with them on (the default) close to it with them off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.quant_helpers import (
    bf16_out_tol,
    one_thread,  # noqa: F401 - autouse: one intra-op thread in this module
)
from worker.kernels import cpu_ext, cpu_quant
from worker.model.cpu_paths import use_dequant_gemm
from worker.model.quant import Int4Linear, Int8Embedding, Int8Linear, _int4_nibble_sources

needs_op = pytest.mark.skipif(
    not cpu_ext.available(), reason="the llm_cpu extension does not build on this machine"
)


def _layout_is_block64() -> bool:
    """The slow probe of worker/model/quant.py (any layout) says whether torch packs as the op reads."""
    n, k = 128, 64
    src = _int4_nibble_sources(n, k)
    b, kk, j, hi = torch.meshgrid(
        torch.arange(n // 64), torch.arange(k), torch.arange(32), torch.arange(2), indexing="ij"
    )
    expected = ((b * 64 + j + 32 * hi) * k + kk).reshape(-1)
    return torch.equal(src, expected)


needs_layout = pytest.mark.skipif(
    not (cpu_ext.available() and _layout_is_block64()),
    reason="torch packs int4 weights in another layout on this CPU (the op is then not used)",
)


@needs_op
def test_layout_probe_agrees_with_the_slow_probe():
    assert cpu_quant._layout_matches() == _layout_is_block64()
    assert cpu_quant.available() == _layout_is_block64()


@needs_layout
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("repeats", [1, 2])
@pytest.mark.parametrize("n", [64, 192])
def test_int4_dequant_matches_the_reference(group_size, repeats, n):
    gen = torch.Generator().manual_seed(group_size + repeats + n)
    k_in = 256
    m = Int4Linear.from_float(torch.randn(n, k_in * repeats, generator=gen), group_size=group_size)
    m.input_repeats, m.in_features = repeats, k_in  # the Q8_0 halves' arrangement
    ref = m.dequantize()  # float32 [N, K_in], the repeats' blocks summed
    b = m._buffers
    w_t = cpu_quant.dequant_t(b["weight_packed"], b["scales_and_zeros"], group_size, repeats)
    assert w_t.dtype == torch.bfloat16 and w_t.shape == (k_in, n)
    # one rounding to bfloat16 of the float32 value (the summation order may differ by an ulp)
    torch.testing.assert_close(w_t.float().t(), ref, rtol=2**-8, atol=1e-6)


@needs_op
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_int8_linear_tiled_matches_the_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    lin = Int8Linear.from_float(torch.randn(200, 96, generator=gen))  # 200 = 3 tiles of 64 + 8
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    ref = x.float() @ lin.dequantize().T
    out = torch.ops.llm_cpu.int8_linear_tiled(x, lin.weight, lin.scales, 64)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    assert float((out.float() - ref).abs().max()) <= 2 * bf16_out_tol(ref)
    assert torch.equal(out, cpu_quant.int8_linear(x, lin.weight, lin.scales)[:, :200])  # tile-independent


@needs_layout
def test_layers_switch_paths_at_their_row_thresholds():
    gen = torch.Generator().manual_seed(7)
    i4 = Int4Linear.from_float(torch.randn(128, 64, generator=gen) * 0.1)
    i8 = Int8Linear.from_float(torch.randn(48, 128, generator=gen))
    emb = Int8Embedding.from_float(torch.randn(100, 48, generator=gen))
    odd = Int4Linear.from_float(torch.randn(80, 64, generator=gen))  # N % 64 != 0: keeps its kernel
    model = nn.Sequential(i4, i8, emb, odd)
    small = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    big = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    before = {name: (f(small), f(big)) for name, f in _paths(model).items()}
    assert use_dequant_gemm(model, 0, 0) == 0
    assert use_dequant_gemm(model, int4_min_rows=8, int8_min_rows=4) == 3
    assert [mod.dequant_min_rows for mod in (i4, i8, emb, odd)] == [8, 4, 4, 0]
    for name, f in _paths(model).items():
        ref_small, ref_big = before[name]
        assert torch.equal(f(small[:2]), ref_small[:2]) or name != "i4", name  # below: the kernel
        out = f(big)
        ref = _reference(model, name, big)
        assert float((out.float() - ref).abs().max()) <= 2 * bf16_out_tol(ref), name
    # above the threshold: exactly the op's matrices through one GEMM
    b = i4._buffers
    w_t = cpu_quant.dequant_t(b["weight_packed"], b["scales_and_zeros"], 32, 1)
    assert torch.equal(i4(big), torch.mm(big, w_t))
    assert torch.equal(odd(big), before["odd"][1])


def _paths(model):
    i4, i8, emb, odd = model

    def chain8(x):
        return i8(i4(x))

    def head(x):
        return emb.linear(i8(i4(x)))

    return {"i4": i4, "i8": chain8, "emb": head, "odd": odd}


def _reference(model, name, x):
    """float32 through the dequantized weights, each layer's input being the bfloat16 output of the
    kernels before it (so only the layer under test differs)."""
    i4, i8, emb, odd = model
    if name == "i4":
        return x.float() @ i4.dequantize().T
    if name == "odd":
        return x.float() @ odd.dequantize().T
    h = i4(x)
    if name == "i8":
        return h.float() @ i8.dequantize().T
    return i8(h).float() @ emb.dequantize().T


@needs_op
def test_bad_arguments_are_value_errors_naming_the_problem():
    m = Int4Linear.from_float(torch.randn(80, 64))
    b = m._buffers
    with pytest.raises(ValueError, match="N % 64"):
        cpu_quant.dequant_t(b["weight_packed"], b["scales_and_zeros"], 32, 1)
    m = Int4Linear.from_float(torch.randn(64, 64))
    b = m._buffers
    with pytest.raises(ValueError, match="scales_and_zeros"):
        cpu_quant.dequant_t(b["weight_packed"], b["scales_and_zeros"].float(), 32, 1)
    with pytest.raises(ValueError, match="repeats"):
        cpu_quant.dequant_t(b["weight_packed"], b["scales_and_zeros"], 32, 3)
    lin = Int8Linear.from_float(torch.randn(32, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_quant.int8_linear(torch.randn(4, 64), lin.weight, lin.scales)
    with pytest.raises(ValueError, match="K=48"):
        cpu_quant.int8_linear(torch.randn(4, 48).to(torch.bfloat16), lin.weight, lin.scales)
    with pytest.raises(ValueError, match="tile"):
        torch.ops.llm_cpu.int8_linear_tiled(torch.randn(4, 64).to(torch.bfloat16), lin.weight, lin.scales, 8)


needs_op = pytest.mark.skipif(not cpu_ext.available(), reason="the llm_cpu extension is unavailable")
needs_vnni = pytest.mark.skipif(
    not (cpu_ext.available() and torch.ops.llm_cpu.vnni_compiled()),
    reason="neither AVX512-VNNI nor AVX2 on this CPU or in its build of the extension: the int8-activation "
    "ops are unused",
)


def test_int4_unpack_reads_this_cpus_layout_as_the_probed_map_does():
    """The W4A8 conversion's fast unpack (views over torch's row blocks of 64 (AVX-512) or 32
    (AVX2), whichever `unpack_block` found here) gives the probed nibble map's values; both block
    layouts invert `_pack_blocks`."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (192, 96), generator=gen, dtype=torch.uint8)
    for block in (32, 64):
        assert torch.equal(cpu_quant.int4_unpack(cpu_quant._pack_blocks(q, block), 192, 96, block), q)
    block = cpu_quant.unpack_block()
    if block is None:
        pytest.skip("torch packs int4 in neither block layout on this CPU: the probed map is used")
    lin = Int4Linear.from_float(torch.randn(192, 96, generator=gen))
    assert torch.equal(cpu_quant.int4_unpack(lin.weight_packed, 192, 96, block), lin.unpacked())


@needs_layout
def test_the_model_runner_switches_every_quantized_module_by_its_flags():
    """CPU workers convert every quantized module of the embedded SmolLM2 to int8 activations where
    the CPU has VNNI (the default); without (or with --no-cpu-int8-activations) the many-row paths
    take over (int4 >= 32 rows, int8 >= 16); 0 turns those off. Accuracy against the float32 model:
    tests/test_quant_smollm.py."""
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner

    def modules(**kw):
        runner = ModelRunner(EngineConfig(kv_cache_bytes=16 * 2**20, num_threads=1, **kw))
        return [mod for mod in runner.model.modules() if hasattr(mod, "dequant_min_rows")]

    if cpu_quant.vnni_available():
        on = modules()
        assert len(on) == 121 and all(getattr(m, "w4a8", False) or getattr(m, "w8a8", False) for m in on)
    off = [m.dequant_min_rows for m in modules(cpu_int8_activations=False)]
    assert off.count(cpu_quant.INT4_MIN_ROWS) == 120 and off.count(cpu_quant.INT8_MIN_ROWS) == 1
    kw = dict(cpu_int8_activations=False, int8_dequant_min_rows=0)
    assert set(m.dequant_min_rows for m in modules(int4_dequant_min_rows=0, **kw)) == {0}
    assert [m.dequant_min_rows for m in modules(int4_dequant_min_rows=5, **kw)].count(5) == 120


@needs_vnni
def test_vnni_layouts_round_trip():
    gen = torch.Generator().manual_seed(11)
    q4 = torch.randint(0, 16, (48, 96), generator=gen, dtype=torch.uint8)
    sz = torch.randn(3, 48, 2, generator=gen).to(torch.bfloat16)
    wq, vsz = cpu_quant.int4_to_vnni(q4, sz)
    assert wq.shape == (3, 12, 16, 4) and vsz.shape == (3, 3, 2, 16)
    back_q, back_sz = cpu_quant.int4_from_vnni(wq, vsz)
    assert torch.equal(back_q, q4) and torch.equal(back_sz, sz)
    q8 = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    wq8, corr = cpu_quant.int8_to_vnni(q8)
    assert torch.equal(cpu_quant.int8_from_vnni(wq8), q8)
    assert torch.equal(corr[1, 0], 128 * q8[16:32, :32].int().sum(1))
    ids = torch.tensor([0, 47, 17, 17, 30])
    assert torch.equal(cpu_quant.int8_rows_from_vnni(wq8, ids), q8[ids])


@needs_op
def test_activation_quantization_is_the_reference_exactly():
    """The ops' per-group int8 rounding (AVX-512 where the build has it) against
    cpu_quant.quantize_reference, value for value: q = round-half-even(x * (127 / amax)),
    d = amax / 127, sums = sum(q); an all-zero group gives 0s; a group with a NaN or inf gives
    d = NaN, q = 0 and sum 0 (so the rows' outputs are NaN); rows enough to run in parallel."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 96, generator=gen) * torch.rand(300, 1, generator=gen) * 8).to(torch.bfloat16)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    x[3, :32] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)  # scale 1: exact ties
    x[4, 32:64] = 1e-38  # 127 / max|x| overflows float32: a zero group
    q, d, sums = torch.ops.llm_cpu.quantize_activations(x)
    want_q, want_d, want_sums = cpu_quant.quantize_reference(x)
    assert torch.equal(q.view(300, 3, 32).float(), want_q) and torch.equal(sums, want_sums)
    finite = ~want_d.isnan()
    assert torch.equal(d[finite], want_d[finite]) and bool(d[~finite].isnan().all())
    assert int((~finite).sum()) == 2 and float(d[0, 0]) == 0.0 and float(sums[0, 0]) == 0.0
    assert q[3, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]  # ties to even
    assert not q[4, 32:64].any() and float(sums[4, 1]) == 0.0 and 0 < float(d[4, 1]) < 1e-39


@needs_op
def test_int8_embedding_lookup_from_the_vnni_layout_matches_torch():
    """The embedding's one-op lookup: bit-identical to unpacking the rows and scaling them in
    torch (repeated ids, a 2-D ids tensor, enough ids to run in parallel); ids outside the rows
    raise ValueError."""
    gen = torch.Generator().manual_seed(3)
    q8 = torch.randint(-127, 128, (96, 64), generator=gen, dtype=torch.int8)
    scale = (torch.rand(96, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    wq8, _ = cpu_quant.int8_to_vnni(q8)
    for ids in (
        torch.tensor([0, 95, 17, 17, 30]),
        torch.randint(0, 96, (3, 7), generator=gen),
        torch.randint(0, 96, (700,), generator=gen),
    ):
        want = q8[ids].to(torch.bfloat16) * scale[ids].unsqueeze(-1)
        got = cpu_quant.int8_vnni_embedding(wq8, scale, ids)
        assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
    for bad in (torch.tensor([96]), torch.tensor([-1])):
        with pytest.raises(ValueError, match="outside the embedding"):
            cpu_quant.int8_vnni_embedding(wq8, scale, bad)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 7, 15, 33])
def test_int8_activation_ops_match_the_reference(rows):
    """Both ops equal the float32 product of the dequantized weight with the activations rounded
    as cpu_quant.round_activations rounds them, up to the bfloat16 output and summation order.
    The ops take rows 8, 4, 2 or 1 at a time (7 = 4 + 2 + 1, 15 = 8 + 4 + 2 + 1, 33 = 4 x 8 + 1)."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 128, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero group: scale 0
    i4 = Int4Linear.from_float(torch.randn(192, 128, generator=gen) * 0.05)
    ref4 = cpu_quant.round_activations(x) @ i4.dequantize().T
    deq, kernel = i4.dequantize(), i4(x)
    assert i4.to_w4a8() and i4.weight_packed is None and i4.scales_and_zeros is None  # no second copy
    assert torch.equal(i4.dequantize(), deq)
    out = i4(x)
    assert float((out.float() - ref4).abs().max()) <= bf16_out_tol(ref4)
    # int8 rounding of the activations vs bfloat16 ones: close, not equal
    assert float((out.float() - kernel.float()).abs().max()) <= 0.05 * float(ref4.abs().max())
    emb = Int8Embedding.from_float(torch.randn(64, 128, generator=gen))
    ids = torch.tensor([3, 63, 0])
    rows_before, deq8 = emb(ids), emb.dequantize()
    assert emb.to_w8a8() and emb.weight is None
    assert torch.equal(emb(ids), rows_before) and torch.equal(emb.dequantize(), deq8)
    ref8 = cpu_quant.round_activations(x) @ deq8.T
    assert float((emb.linear(x).float() - ref8).abs().max()) <= bf16_out_tol(ref8)
    lin = Int8Linear.from_float(torch.randn(32, 128, generator=gen))
    ref_lin = cpu_quant.round_activations(x) @ lin.dequantize().T
    assert lin.to_w8a8() and float((lin(x).float() - ref_lin).abs().max()) <= bf16_out_tol(ref_lin)


@needs_vnni
def test_int8_activation_conversion_skips_shapes_the_ops_do_not_take():
    assert not Int4Linear.from_float(torch.randn(80, 64)).to_w4a8()  # N % 64
    assert not Int4Linear.from_float(torch.randn(64, 128), group_size=64).to_w4a8()
    assert not Int8Linear.from_float(torch.randn(24, 64)).to_w8a8()  # N % 16
    assert not Int8Linear.from_float(torch.randn(32, 48)).to_w8a8()  # K % 32
    model = nn.Sequential(*(Int4Linear.from_float(torch.randn(n, 64)) for n in (64, 80)))
    from worker.model.cpu_paths import use_int8_activations

    assert use_int8_activations(model) == 1
    assert use_dequant_gemm(model, 8, 8) == 0 and model[0].dequant_min_rows == 0  # VNNI kept; N=80: neither
    x = torch.randn(3, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="wq must be"):
        wq = torch.zeros(4, 8, 16, 4, dtype=torch.uint8)
        cpu_quant.int4_vnni(x, wq, torch.zeros(4, 4, 2, 16).bfloat16())
    with pytest.raises(ValueError, match="corr must be"):
        cpu_quant.int8_vnni(
            x, torch.zeros(2, 32, 16, 4, dtype=torch.int8), torch.zeros(2, 4, 16), torch.zeros(32).bfloat16()
        )


def test_without_vnni_nothing_is_converted_and_the_kernels_stay(monkeypatch):
    """On a CPU (or build) without int8 dot products the conversions refuse, whoever calls them, and the
    modules keep torch's kernels: a converted module would have dropped its weights for an op that
    cannot run there. Runs on every machine (the probe is forced off)."""
    from worker.model.cpu_paths import row_thresholds, use_int8_activations

    monkeypatch.setattr(cpu_quant, "vnni_available", lambda: False)
    model = nn.Sequential(
        Int4Linear.from_float(torch.randn(64, 64)), Int8Linear.from_float(torch.randn(32, 64))
    )
    emb = Int8Embedding.from_float(torch.randn(32, 64))
    assert use_int8_activations(model) == 0
    assert not model[0].to_w4a8() and not model[1].to_w8a8() and not emb.to_w8a8()
    assert model[0].weight_packed is not None and model[1].weight is not None and emb.weight is not None
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert torch.equal(emb.linear(x), torch.ops.llm_quant.int8_mm(x, emb.weight, emb.scales))
    assert row_thresholds(model) == set()
    if cpu_quant.available():
        assert use_dequant_gemm(model, 32, 16) == 2 and row_thresholds(model) == {16, 32}


@needs_vnni
def test_int8_activation_ops_propagate_nan_and_inf_rows():
    """A row holding a NaN or an inf comes out all NaN (as the float product would), not as finite
    numbers from a scale that skipped it; the other rows are untouched."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    i4 = Int4Linear.from_float(torch.randn(64, 64, generator=gen) * 0.05)
    emb = Int8Embedding.from_float(torch.randn(32, 64, generator=gen))
    assert i4.to_w4a8() and emb.to_w8a8()
    clean4, clean8 = i4(x), emb.linear(x)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 40] = bad
        for out, clean in ((i4(y), clean4), (emb.linear(y), clean8)):
            assert out[1].isnan().all()
            assert torch.equal(out[[0, 2]], clean[[0, 2]])
