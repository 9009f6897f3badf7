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
from worker.kernels import cpu_attention, cpu_quant
from worker.model.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    _int4_nibble_sources,
    use_dequant_gemm,
)

needs_op = pytest.mark.skipif(
    not cpu_attention.available(), reason="the llm_cpu extension does not build on this machine"
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
    not (cpu_attention.available() and _layout_is_block64()),
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


@needs_layout
def test_the_model_runner_switches_every_quantized_module_by_its_flags():
    """CPU workers take the paths by default (int4 >= 32 rows, int8 >= 8: every int4 linear and
    the tied int8 lm_head of the embedded SmolLM2); 0 turns them off. Their accuracy against the
    float32 model: tests/test_quant_smollm.py."""
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner

    def thresholds(**kw):
        runner = ModelRunner(EngineConfig(kv_cache_bytes=16 * 2**20, num_threads=1, **kw))
        return [getattr(mod, "dequant_min_rows", None) for mod in runner.model.modules()]

    on = thresholds()
    assert on.count(cpu_quant.INT4_MIN_ROWS) == 120 and on.count(cpu_quant.INT8_MIN_ROWS) == 1
    assert set(thresholds(int4_dequant_min_rows=0, int8_dequant_min_rows=0)) <= {None, 0}
    assert thresholds(int4_dequant_min_rows=5, int8_dequant_min_rows=0).count(5) == 120
