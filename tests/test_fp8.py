"""FP8 W8A8 weights (worker/model/fp8.py) and the fp8 KV cache (--kv-cache-dtype fp8).

On CPU (torch 2.13's CPU build runs torch._scaled_mm for float8_e4m3fn): the op against its
float32 reference formula, the quantization error bound, a model converted in place, and the whole
engine with `--quantization fp8` against the same engine running the reference formula. The fp8
KV cache through the engine needs CUDA (the Triton interpreter rounds bf16 -> fp8 wrongly; the
kernel itself is checked on CPU by tests/test_kernels.py::test_paged_attention_fp8_kv_cache).
"""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig, ModelConfig
from worker.engine import LLMEngine
from worker.model.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_fp8, quantize_model_fp8
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=256,
)
# On a GPU machine the op tests run on CUDA (the path serving uses; that machine's torch may also
# lack the CPU build's row-wise scaled_mm), elsewhere on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41], [44, 12, 3], [120, 110, 100, 90, 80, 70]]


def tiny_model(dtype=torch.bfloat16, device="cpu") -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(TINY).to(device=device, dtype=dtype).eval()


def test_quantize_fp8_error_bound():
    torch.manual_seed(1)
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different ranges
    w[7] = 0
    q, scale = quantize_fp8(w, dim=1)
    assert q.dtype == FP8 and scale.shape == (48, 1) and scale[7] == 1
    deq = q.float() * scale
    # e4m3: 3 mantissa bits, so rounding is within 2^-4 relative; below the normal range
    # (2^-6 * scale) the step is 2^-9 * scale.
    bound = w.abs() * 2**-4 + scale * 2**-10
    assert bool(((deq - w).abs() <= bound).all())
    assert torch.equal(deq.abs().amax(dim=1), torch.where(scale[:, 0] == 1, 0.0, scale[:, 0] * FP8_MAX))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (40, 24)])  # (40, 24): not multiples of 16, the fallback
@torch.no_grad()
def test_fp8_linear_matches_reference(bias, shape):
    torch.manual_seed(2)
    k, n = shape
    lin = torch.nn.Linear(k, n, bias=bias).to(DEVICE, torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    assert f.use_op == (k % 16 == 0 and n % 16 == 0)
    x = torch.randn(3, 5, k).to(DEVICE, torch.bfloat16)
    out, ref = f(x), f.forward_reference(x)
    assert out.shape == (3, 5, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    # ... and both are the bf16 layer up to fp8 rounding of weights and activations.
    dense = lin(x).float()
    assert float((out.float() - dense).abs().max() / dense.abs().max()) < 0.1


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
    config = EngineConfig(kv_cache_bytes=2**21, max_num_seqs=4, max_num_batched_tokens=64, **overrides)
    runner = ModelRunner.from_model(config, model)
    logits: dict[str, list[torch.Tensor]] = {}
    runner.logits_observer = lambda ids, rows: [
        logits.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)
    ]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = LLMEngine(config, runner=runner).generate(PROMPTS, sp)
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


def test_engine_fp8_weights_match_the_reference_formula():
    """--quantization fp8 through the engine: the _scaled_mm path gives the tokens and (to bf16
    rounding) the logits of the same engine running Fp8Linear.forward_reference."""
    fast_tokens, fast_logits = run_engine(
        tiny_model(device=DEVICE), quantization="fp8", attention_backend="torch", enforce_eager=True
    )
    model = tiny_model(device=DEVICE)
    quantize_model_fp8(model)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.forward = m.forward_reference
    ref_tokens, ref_logits = run_engine(
        model, quantization="fp8", attention_backend="torch", enforce_eager=True
    )
    assert fast_tokens == ref_tokens
    for rid, ref in ref_logits.items():
        assert float((fast_logits[rid] - ref).abs().max() / ref.abs().max()) < 2e-2
    # And close to bf16 (a random model's logits are flat, so only the error is checked).
    _, bf16_logits = run_engine(tiny_model(device=DEVICE), attention_backend="torch", enforce_eager=True)
    for rid, ref in bf16_logits.items():
        assert float((fast_logits[rid] - ref).abs().max() / ref.abs().max()) < 0.15


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
