"""The W8A16 fp8 GEMM (worker/kernels/triton_fp8_gemm.py: prefill, mixed steps and decode batches
> 16 of `--quantization fp8` on CUDA, `Fp8Linear.forward_gemm`).

Error: max|out - ref| / max|ref| against the float32 product with the dequantized weight,
`x.float() @ (q.float() * scale[n, k // group]).T + b` (per row: `scale[n]`): widening e4m3 is
exact and the kernel scales each group's float32 partial, so the bound is one rounding of the
output (the interpreter truncates: 2^-7 for bfloat16, 2^-10 for float16; half that on CUDA) plus
float32 accumulation. Weights get a different range per group (three decades) and an outlier, so
a kernel that applied the wrong group's scale, or one scale per row, fails by far (checked). Outputs
are NaN-poisoned first. Without CUDA the kernel runs under the Triton interpreter (small cases).
"""

import pytest
import torch

from tests.triton_device import DEVICE
from worker.kernels import triton_fp8_gemm as tfg
from worker.kernels.triton_fp8_gemm import FP8, fp8_gemm
from worker.model.fp8 import Fp8Linear, quantize_fp8

ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 0.0}


def bound(dtype):
    return ROUNDING[dtype] / (2 if DEVICE == "cuda" else 1) + 1e-5


def operands(m, n, k, group, dtype, bias, seed):
    """x in dtype; W quantized to e4m3 (per group of K columns, or per row with group 0), the
    groups' ranges spread over three decades; the float32 reference."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    groups = -(-k // (group or k))
    spread = torch.logspace(-2, 1, groups)[torch.randperm(groups, generator=gen)]
    w = torch.randn(n, k, generator=gen) * spread.repeat_interleave(group or k)[:k]
    w[0, k // 2] = 50.0  # an outlier: only its own group's scale grows
    q, scale = quantize_fp8(w, dim=1, group_size=group)
    scale = scale if group else scale[:, 0].contiguous()
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    full = scale.repeat_interleave(group, dim=1)[:, :k] if group else scale[:, None]
    ref = x.to(dtype).float() @ (q.float() * full).T + (b.float() if bias else 0)
    return x.to(DEVICE, dtype), q.to(DEVICE), scale.to(DEVICE), b, ref.to(DEVICE)


def rel_error(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max())


def run(x, q, scale, b, group, config=None):
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    assert fp8_gemm(x, q, scale, b, group, out=out, config=config) is out
    assert not out.isnan().any(), "output left unwritten"
    return out


# (M, N, K, group, dtype, bias): M across the configs (1, 17, 40, 130: two 128-row tiles); odd N;
# K = 200 / 576 / 136 ending in a shorter group and tile; float16; per row; float32 ("ieee" dots).
CASES = [
    (1, 37, 200, 64, torch.bfloat16, True),
    (17, 73, 200, 128, torch.bfloat16, False),
    (40, 41, 576, 128, torch.float16, True),
    (130, 33, 136, 64, torch.bfloat16, True),
    (40, 24, 200, 0, torch.bfloat16, True),
    (17, 40, 80, 64, torch.float32, False),
]


@pytest.mark.parametrize(
    "case", CASES, ids=[f"m{m}-{n}x{k}g{g}-{str(d)[6:]}-b{int(b)}" for m, n, k, g, d, b in CASES]
)
def test_fp8_gemm_matches_float32_product(case):
    m, n, k, group, dtype, bias = case
    x, q, scale, b, ref = operands(m, n, k, group, dtype, bias, seed=m + k)
    out = run(x, q, scale, b, group)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, ref) < bound(dtype)
    if group:  # per row (the first group's scale) is far off: the group scales are really applied
        assert rel_error(fp8_gemm(x, q, scale[:, 0].contiguous(), b), ref) > 0.1


@pytest.mark.parametrize("config", [c for _, c in tfg.CONFIGS], ids=str)
def test_every_config_with_strided_rows(config):
    """Each config (block_k capped at the group of 64) on x and out that are row-strided views of
    wider tensors, K = 200: every tile shape, the wrapped rows / columns and the K tail."""
    m, n, k, group = 21, 50, 200, 64
    x, q, scale, b, ref = operands(m, n, k, group, torch.bfloat16, True, seed=3)
    wide = torch.zeros(m, k + 24, dtype=x.dtype, device=DEVICE)
    wide[:, 8 : 8 + k] = x
    out_wide = torch.full((m, n + 6), float("nan"), dtype=x.dtype, device=DEVICE)
    fp8_gemm(wide[:, 8 : 8 + k], q, scale, b, group, out=out_wide[:, :n], config=config)
    assert not out_wide[:, :n].isnan().any() and out_wide[:, n:].isnan().all()  # nothing past N
    assert rel_error(out_wide[:, :n], ref) < bound(torch.bfloat16)


def test_config_for_rows():
    assert [tfg.config_for(m).block_m for m in (1, 16, 17, 33, 64, 65, 129, 4096)] == [
        16,
        16,
        32,
        64,
        64,
        64,
        128,
        128,
    ]
    with pytest.raises(ValueError, match="powers of two"):
        tfg.GemmConfig(48, 64, 64)


@pytest.mark.parametrize("group", [128, 0])
@torch.no_grad()
def test_fp8_linear_forward_gemm_matches_reference(group):
    """Fp8Linear's GEMM path (what its forward takes on CUDA for rows the GEMV does not take),
    called directly so it runs interpreted here too: == forward_reference up to one rounding."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(200, 48, bias=True).to(DEVICE, torch.bfloat16)
    f = Fp8Linear.from_linear(lin, group)
    x = torch.randn(2, 20, 200).to(DEVICE, torch.bfloat16)
    out = f.forward_gemm(x)
    assert out.shape == (2, 20, 48)
    ref = x.float() @ f.dequantize().T + f.bias.float()  # per channel: W8A16 too (x not quantized)
    assert rel_error(out, ref) < bound(torch.bfloat16)
    if DEVICE == "cuda" and group:  # forward routes these 40 rows to the GEMM
        assert torch.equal(f(x), out) and (f.gemm_calls, f.dense_calls) == (1, 0)


def test_bad_inputs_raise_value_error():
    x, q, scale, b, _ = operands(4, 24, 64, 32, torch.bfloat16, True, seed=1)
    bad = {
        "dense weight": lambda: fp8_gemm(x, q.to(torch.bfloat16), scale),
        "no scale": lambda: fp8_gemm(x, q, None, group_size=32),
        "scale shape": lambda: fp8_gemm(x, q, scale[:, :1].contiguous(), group_size=32),
        "group 48": lambda: fp8_gemm(x, q, scale, group_size=48),
        "per-row scale for groups": lambda: fp8_gemm(x, q, scale[:, 0].contiguous(), group_size=32),
        "no rows": lambda: fp8_gemm(x[:0], q, scale, group_size=32),
        "K mismatch": lambda: fp8_gemm(x[:, :32], q, scale, group_size=32),
        "x last dim strided": lambda: fp8_gemm(x.t().contiguous().t(), q, scale, group_size=32),
        "out dtype": lambda: fp8_gemm(x, q, scale, group_size=32, out=torch.empty(4, 24, device=DEVICE)),
        "bias shape": lambda: fp8_gemm(x, q, scale, b[:8], group_size=32),
        "int x": lambda: fp8_gemm(x.to(torch.int32), q, scale, group_size=32),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(name)
    assert q.dtype == FP8 and not fp8_gemm(x, q, scale, b, 32).isnan().any()  # the good call runs


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_fp8_gemm_replays_in_a_cuda_graph():
    """Captured once per config (64 rows: a decode batch; 512: prefill), replayed on new inputs:
    nothing allocated or synced during capture, the values follow the new x."""
    for m in (64, 512):
        x, q, scale, b, _ = operands(m, 2048, 2048, 128, torch.bfloat16, True, seed=m)
        out = torch.empty(m, 2048, dtype=torch.bfloat16, device=DEVICE)
        fp8_gemm(x, q, scale, b, 128, out=out)  # compile before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fp8_gemm(x, q, scale, b, 128, out=out)
        x.copy_(torch.randn(m, 2048, generator=torch.Generator().manual_seed(7)).to(DEVICE, x.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        full = scale.repeat_interleave(128, dim=1)
        ref = x.float() @ (q.float() * full).T + b.float()
        assert rel_error(out, ref) < bound(torch.bfloat16)


def test_gemv_bench_grouped_rows_smoke():
    """benchmarks/gpu_gemv.py's `fp8-g128` rows (the CLI's default; gpu_decode leaves them off):
    the grouped GEMV at <= 16 rows, the GEMM above, each timed against bf16 F.linear and
    dequantize + F.linear, with the kernel's error within one rounding of the float32 product."""
    from benchmarks import gpu_gemv

    shapes = gpu_gemv.SMOKE_SHAPES[1:] if DEVICE == "cpu" else gpu_gemv.LLAMA_1B_SHAPES[:1]
    rows = gpu_gemv.gemv_bench(DEVICE, shapes, rows=(3,), grouped=True, gemm_rows=(20,))
    grouped = [r for r in rows if r["kind"] == "fp8-g128"]
    assert [(r["path"], r["rows"]) for r in grouped] == [("gemv", 3), ("gemm", 20)]
    for r in grouped:
        assert min(r["kernel_us"], r["cublas_us"], r["dense_us"]) > 0
        # dequantize + F.linear also rounds the weight to bf16 (2^-9 per element)
        assert r["kernel_rel_err"] < bound(torch.bfloat16) and r["dense_rel_err"] < 2**-6
    text = gpu_gemv.rows_to_markdown(rows, bandwidth_gbs=1000.0)
    assert "FP8 per group" in text and text.count(" | gemm | ") == 1 and text.count(" | gemv | ") == 1
