"""FP8 weights (worker/model/fp8.py: per-group scales, W8A16 everywhere, the default; per-channel
scales, W8A8, `--fp8-group-size 0`; the Triton GEMV at decode for both) and the fp8 KV cache
(--kv-cache-dtype fp8).

On CPU (torch 2.13's CPU build runs torch._scaled_mm for float8_e4m3fn): the op against its
float32 reference formula, the quantization error bound, a model converted in place, and the whole
engine with `--quantization fp8` against the same engine running the reference formula. The fp8
KV cache through the engine needs CUDA (the Triton interpreter rounds bf16 -> fp8 wrongly; the
kernel itself is checked on CPU by tests/test_kernels.py::test_paged_attention_fp8_kv_cache).
The W8A16 GEMV only reads fp8 (widening is exact, also interpreted: tests/test_gemv.py checks every
e4m3 value), so its model tests run on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_llama import TINY
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_fp8, quantize_model_fp8, use_fp8_gemv
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

# On a GPU machine the op tests run on CUDA (the path serving uses; that machine's torch may also
# lack the CPU build's row-wise scaled_mm), elsewhere on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41], [44, 12, 3], [120, 110, 100, 90, 80, 70]]


def tiny_model(dtype=torch.bfloat16, device="cpu") -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(TINY).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("group", [0, 16, 32])  # 32: K = 80 ends in a group of 16
def test_quantize_fp8_error_bound(group):
    """Per channel (scale [N, 1]) or per group of K columns (scale [N, cdiv(K, group)]): each
    element within e4m3's rounding of its own slice's scale, each slice's max at exactly 448 x
    its scale, an all-zero slice scaled by 1."""
    torch.manual_seed(1)
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different ranges
    w[7] = 0
    w[9, : group or 80] = 0  # a zero group (the whole row per channel)
    w[11, 3] = 1e3  # an outlier: per group it only coarsens its own group
    q, scale = quantize_fp8(w, dim=1, group_size=group)
    groups = -(-80 // group) if group else 1
    assert q.dtype == FP8 and scale.shape == (48, groups) and bool((scale[7] == 1).all()) and scale[9, 0] == 1
    full = scale.repeat_interleave(group or 80, dim=1)[:, :80]  # each element's scale
    deq = q.float() * full
    # e4m3: 3 mantissa bits, so rounding is within 2^-4 relative; below the normal range
    # (2^-6 * scale) the step is 2^-9 * scale.
    bound = w.abs() * 2**-4 + full * 2**-10
    assert bool(((deq - w).abs() <= bound).all())
    cols = torch.arange(80) // (group or 80)
    amax = torch.zeros(48, groups).scatter_reduce(1, cols.expand(48, 80), deq.abs(), "amax")
    assert torch.equal(amax, torch.where(scale == 1, 0.0, scale * FP8_MAX))
    if group:  # the outlier's neighbours in other groups keep their fine scale
        assert scale[11, 1] < scale[11, 0] / 100


@pytest.mark.parametrize("group", [0, 32])  # 0: W8A8 _scaled_mm; 32: W8A16 (GEMM on CUDA, else dense)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (40, 24)])  # (40, 24): not multiples of 16 (or of 32)
@torch.no_grad()
def test_fp8_linear_matches_reference(bias, shape, group):
    torch.manual_seed(2)
    k, n = shape
    lin = torch.nn.Linear(k, n, bias=bias).to(DEVICE, torch.bfloat16)
    f = Fp8Linear.from_linear(lin, group)
    assert f.use_op == (not group and k % 16 == 0 and n % 16 == 0)
    assert f.scale.shape == ((n, -(-k // group)) if group else (1, n))
    x = torch.randn(3, 5, k).to(DEVICE, torch.bfloat16)
    out, ref = f(x), f.forward_reference(x)
    assert out.shape == (3, 5, n) and out.dtype == torch.bfloat16
    gemm = int(bool(group) and DEVICE == "cuda")  # per group on CUDA: the Triton fp8 GEMM
    assert (f.gemm_calls, f.dense_calls, f.w8a8_calls) == ((gemm, 1 - gemm, 0) if group else (0, 0, 1))
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    # ... and both are the bf16 layer up to fp8 rounding of the weights (and of the activations
    # for W8A8).
    dense = lin(x).float()
    assert float((out.float() - dense).abs().max() / dense.abs().max()) < (0.06 if group else 0.1)


def test_fp8_group_size_is_checked():
    q = torch.zeros(8, 40).to(FP8)
    with pytest.raises(ValueError, match="power of two"):
        Fp8Linear(q, torch.ones(8, 1), group_size=48)
    with pytest.raises(ValueError, match="scale"):
        Fp8Linear(q, torch.ones(8, 1), group_size=16)  # needs [8, 3]
    assert Fp8Linear(q, torch.ones(8, 3), group_size=16).scale.shape == (8, 3)
    with pytest.raises(ValueError, match="fp8_group_size"):
        EngineConfig(fp8_group_size=48)
    assert EngineConfig(fp8_group_size=0).fp8_group_size == 0


@pytest.mark.parametrize("k", [64, 3000])
def test_triton_quantize_rows_matches_torch(k):
    """The one-kernel activation quantizer == quantize_fp8: scales exactly (on CUDA within 1 ulp:
    torch's reference multiplies by 1/448 there), the scaled clamped values exactly (float32
    output; the interpreter cannot round to fp8) and, on CUDA, the fp8 values exactly as torch
    rounds them."""
    from worker.kernels.triton_quant import quantize_rows_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    x = (torch.randn(6, k) * torch.logspace(-3, 3, 6)[:, None]).to(device, torch.bfloat16)
    x[4] = 0
    ref_q, ref_scale = quantize_fp8(x, dim=1)
    q32, scale = quantize_rows_fp8(x, torch.float32)
    assert scale[4] == 1
    if device == "cpu":
        assert torch.equal(scale, ref_scale)
    else:  # torch on CUDA divides by a Python scalar as a multiply by its reciprocal: 1 ulp apart
        torch.testing.assert_close(scale, ref_scale, rtol=2**-22, atol=0)
    assert torch.equal(q32, (x.float() / scale).clamp(-FP8_MAX, FP8_MAX))
    if device == "cuda":
        q, _ = quantize_rows_fp8(x)
        expected = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # torch's fp8 rounding
        assert q.dtype == FP8 and torch.equal(q.float(), expected.float())


def test_quantize_model_fp8_in_place():
    model = tiny_model()
    assert quantize_model_fp8(model) == 4 * TINY.num_layers  # qkv, o, gate|up, down per layer
    assert quantize_model_fp8(model) == 0  # already converted
    assert isinstance(model.layers[0].self_attn.o_proj, Fp8Linear)
    assert type(model.embed_tokens) is torch.nn.Embedding and model.lm_head is None  # tied, dense


def run_engine(model: LlamaModel, **overrides) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    overrides = {"device": DEVICE, **overrides}
    config = EngineConfig(
        kv_cache_bytes=2**21,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_speculative_tokens=0,  # one logits row per request per step, comparable across runs
        **overrides,
    )
    runner = ModelRunner.from_model(config, model)
    logits: dict[str, list[torch.Tensor]] = {}
    runner.logits_observer = lambda ids, rows: [
        logits.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)
    ]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = LLMEngine(config, runner=runner).generate(PROMPTS, sp)
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("group", [0, 128])  # the old W8A8 form and the default W8A16 one
def test_engine_fp8_weights_match_the_reference_formula(group):
    """--quantization fp8 through the engine: the fast path (_scaled_mm per channel; dequantize +
    F.linear per group) gives the tokens and (to bf16 rounding) the logits of the same engine
    running Fp8Linear.forward_reference."""
    kw = dict(quantization="fp8", fp8_group_size=group, attention_backend="torch", enforce_eager=True)
    fast_tokens, fast_logits = run_engine(tiny_model(device=DEVICE), **kw)
    model = tiny_model(device=DEVICE)
    quantize_model_fp8(model, group)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.forward = m.forward_reference
    ref_tokens, ref_logits = run_engine(model, **kw)
    assert fast_tokens == ref_tokens
    for rid, ref in ref_logits.items():
        assert float((fast_logits[rid] - ref).abs().max() / ref.abs().max()) < 2e-2
    # And close to bf16 (a random model's logits are flat, so only the error is checked).
    _, bf16_logits = run_engine(tiny_model(device=DEVICE), attention_backend="torch", enforce_eager=True)
    for rid, ref in bf16_logits.items():
        assert float((fast_logits[rid] - ref).abs().max() / ref.abs().max()) < 0.15


@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_fp8_linear_gemv_path_and_fallbacks(bias, group):
    """use_fp8_gemv forced (the default config per bucket): 1..16 rows run the W8A16 GEMV (with the
    per-channel or per-group scales), equal to its float32 formula `x @ dequantize().T + b` up to
    one bf16 rounding (2^-7: the interpreter truncates; half that on CUDA); 17 rows, a [2, 20, K]
    input, and rows above max_rows fall back to the module's other path (_scaled_mm per channel,
    per group the Triton GEMM on CUDA, dequantize + F.linear on CPU) and give exactly the plain
    Fp8Linear's output (counted)."""
    torch.manual_seed(4)
    k, n = 96, 80  # group 32: three groups per row
    lin = torch.nn.Linear(k, n, bias=bias).to(DEVICE, torch.bfloat16)
    f, plain = Fp8Linear.from_linear(lin, group), Fp8Linear.from_linear(lin, group)
    fallback = ("gemm_calls" if DEVICE == "cuda" else "dense_calls") if group else "w8a8_calls"
    assert use_fp8_gemv(f, force=True) == 1 and sorted(f.gemv_configs) == [1, 2, 4, 8, 16]
    deq = f.dequantize()
    for m in range(1, 17):
        x = torch.randn(1, m, k).to(DEVICE, torch.bfloat16)
        ref = x.float() @ deq.T + (f.bias.float() if bias else 0)
        out = f(x)
        assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
        assert float((out.float() - ref).abs().max() / ref.abs().max()) < 2**-7 + 1e-5, m
    assert (f.gemv_calls, getattr(f, fallback)) == (16, 0)
    for shape in [(17, k), (2, 20, k)]:
        x = torch.randn(shape).to(DEVICE, torch.bfloat16)
        assert torch.equal(f(x), plain(x))
    assert (f.gemv_calls, getattr(f, fallback)) == (16, 2)
    assert use_fp8_gemv(f, force=True) == 0  # already enabled: kept
    f3 = Fp8Linear.from_linear(lin, group)
    assert use_fp8_gemv(f3, max_rows=3, force=True) == 1 and sorted(f3.gemv_configs) == [1, 2, 4]
    x = torch.randn(4, k).to(DEVICE, torch.bfloat16)  # in bucket 4, above max_rows
    assert torch.equal(f3(x), plain(x)) and (f3.gemv_calls, getattr(f3, fallback)) == (0, 1)
    assert "W8A16 triton gemv up to 3 rows" in repr(f3)
    with pytest.raises(ValueError):
        use_fp8_gemv(f, max_rows=17)
    f32 = Fp8Linear.from_linear(lin.float(), group)  # float32 activations: left on the other path
    assert use_fp8_gemv(f32, force=True) == 0 and not f32.gemv_configs


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the pass times")
def test_use_fp8_gemv_leaves_cpu_modules_alone_unless_forced():
    model = tiny_model()
    quantize_model_fp8(model)
    assert use_fp8_gemv(model) == 0
    assert not any(m.gemv_configs for m in model.modules() if isinstance(m, Fp8Linear))


def rel_errors(logits: dict, ref: dict) -> torch.Tensor:
    """[requests, steps] relative max logit error of each sampled step against `ref`."""
    rows = [(logits[r].float() - ref[r].float()).abs().amax(1) / ref[r].float().abs().amax(1) for r in ref]
    return torch.stack(rows)


@pytest.mark.parametrize("group", [128, 32])  # the default (one group per row here) and 2..4 groups
def test_engine_fp8_grouped_is_no_worse_than_w8a8(group):
    """The same greedy run three ways: bf16, the old --quantization fp8 (`--fp8-group-size 0`:
    W8A8 everywhere) and the per-group form with the GEMV forced (the 17-row prefill runs
    dequantize + F.linear, on CUDA the Triton GEMM; the 3-row decode steps the grouped GEMV; both
    W8A16). Against bf16's
    logits (relative max error per request and step; this random model repeats its last prompt
    token, so every run samples the same tokens and every step is comparable): the same greedy
    tokens as bf16, the prefill step's and the decode steps' mean errors no larger than W8A8's
    (measured on CPU, group 128: prefill 0.0052 vs 0.0070, decode 0.0049 vs 0.0071; group 32:
    0.0050 and 0.0056; 5% slack for rounding noise),
    and below 0.02 everywhere."""
    kw = dict(attention_backend="torch", enforce_eager=True)
    bf16_tokens, bf16 = run_engine(tiny_model(device=DEVICE), **kw)
    _, w8a8 = run_engine(tiny_model(device=DEVICE), quantization="fp8", fp8_group_size=0, **kw)
    model = tiny_model(device=DEVICE)
    quantize_model_fp8(model, group)
    assert use_fp8_gemv(model, force=True) == 4 * TINY.num_layers
    tokens, grouped = run_engine(model, quantization="fp8", fp8_group_size=group, **kw)
    assert tokens == bf16_tokens
    for m in model.modules():
        if isinstance(m, Fp8Linear):  # 5 decode steps of 3 rows; one 17-row prefill
            assert (m.gemv_calls, m.dense_calls + m.gemm_calls, m.w8a8_calls) == (5, 1, 0)
            assert m.gemm_calls == (DEVICE == "cuda")  # the prefill: the Triton GEMM on CUDA
    err, w8a8_err = rel_errors(grouped, bf16), rel_errors(w8a8, bf16)
    assert err.shape == (len(PROMPTS), 6)
    assert float(err[:, 0].mean()) <= 1.05 * float(w8a8_err[:, 0].mean())
    assert float(err[:, 1:].mean()) <= 1.05 * float(w8a8_err[:, 1:].mean())
    assert float(err.max()) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the timing and graphs need CUDA")
def test_fp8_gemv_timed_and_replayed_on_cuda():
    """use_fp8_gemv times the GEMV against W8A8 per shape and bucket (the report's decision
    follows the times); the forced GEMV runs inside the runner's CUDA graphs, close to bf16."""
    model = tiny_model(device="cuda")
    quantize_model_fp8(model)
    enabled = use_fp8_gemv(model)
    report = model.fp8_gemv_report
    base = "gemm_us"  # the default per-group form: the GEMV replaces the Triton fp8 GEMM
    assert len(report) == 4 * 5 and all(r["gemv_us"] > 0 and r[base] > 0 for r in report)
    assert all(r["use"] == (r["gemv_us"] < r[base]) for r in report)
    assert enabled == 2 * len({(r["n"], r["k"]) for r in report if r["use"]})  # 2 layers per shape
    common = dict(device="cuda", gpu_memory_utilization=0.02, max_model_len=256)
    ref_tokens, ref_logits = run_engine(tiny_model(device="cuda"), **common)
    forced = tiny_model(device="cuda")
    quantize_model_fp8(forced)
    use_fp8_gemv(forced, force=True)
    tokens, logits = run_engine(forced, quantization="fp8", **common)
    assert [len(t) for t in tokens] == [len(t) for t in ref_tokens]
    assert float(rel_errors(logits, ref_logits).max()) < 0.15
    assert all(m.gemv_calls > 0 for m in forced.modules() if isinstance(m, Fp8Linear))


def test_fp8_kv_cache_needs_triton():
    config = EngineConfig(kv_cache_bytes=2**20, kv_cache_dtype="fp8", attention_backend="torch")
    with pytest.raises(ValueError, match="triton"):
        ModelRunner.from_model(config, tiny_model())


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the interpreter's fp8 rounding is wrong)"
)
def test_engine_fp8_kv_cache_and_weights_on_cuda():
    """bf16 model on CUDA: fp8 KV cache, fp8 weights and both, graphs on, vs bf16 logits."""
    common = dict(device="cuda", gpu_memory_utilization=0.02, max_model_len=256)
    ref_tokens, ref_logits = run_engine(tiny_model(device="cuda"), **common)
    for extra in (
        dict(kv_cache_dtype="fp8"),
        dict(quantization="fp8"),
        dict(kv_cache_dtype="fp8", quantization="fp8"),
    ):
        tokens, logits = run_engine(tiny_model(device="cuda"), **common, **extra)
        assert [len(t) for t in tokens] == [len(t) for t in ref_tokens]
        for rid, ref in ref_logits.items():
            err = float((logits[rid] - ref).abs().max() / ref.abs().max())
            assert err < 0.15, f"{extra}: {rid} relative logit error {err:.3f}"
