"""The fp8 GEMV with per-group weight scales (worker/kernels/triton_gemv.py, `group_size` > 0: the
default `--quantization fp8` form, worker/model/fp8.py), split from tests/test_gemv.py (which holds
the per-channel and dense cases and the bounds' reasoning).

Error: max|out - ref| / max|ref| against the float32 product with the dequantized weight,
`x.float() @ (q.float() * scale[n, k // group]).T + b` (widening e4m3 is exact; the kernel scales
each group's float32 partial, or each widened element on the one-row path, in float32), with
test_gemv's bounds: one rounding of the output (the interpreter truncates bfloat16: 2^-7) plus
float32 accumulation. Weights get a different range per group (and an outlier), so a kernel that
applied the wrong group's scale, or one scale per row, fails by far. Outputs and split-K scratch
are NaN-poisoned first. Without CUDA the kernels run under the Triton interpreter (small cases).
"""

import pytest
import torch

from tests.triton_device import DEVICE
from worker.kernels import triton_gemv as tg
from worker.kernels.triton_gemv import FP8, gemv
from worker.model.fp8 import quantize_fp8

BOUND = {torch.bfloat16: (2**-7 if DEVICE == "cpu" else 2**-8) + 1e-5, torch.float32: 1e-5}


def grouped_operands(m, n, k, group, dtype, bias, seed):
    """x in dtype; W quantized to e4m3 with one float32 scale per row and group of K columns,
    the groups' ranges spread over three decades; the float32 reference; the scale on DEVICE with NaN
    right after its last element."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    spread = torch.logspace(-2, 1, -(-k // group))[torch.randperm(-(-k // group), generator=gen)]
    w = torch.randn(n, k, generator=gen) * spread.repeat_interleave(group)[:k]
    w[0, k // 2] = 50.0  # an outlier: only its own group's scale grows
    q, scale = quantize_fp8(w, group_size=group)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # on the CPU, as the reference
    deq = q.float() * scale.repeat_interleave(group, dim=1)[:, :k]
    ref = x.to(dtype).float() @ deq.T + (b.float() if bias else 0)
    b = b.to(DEVICE) if bias else None
    # The scale as a view into a buffer whose tail is NaN: a load past its last group (a split's
    # tiles beyond K) poisons the output instead of reading whatever memory follows.
    tail = torch.full((scale.numel() + 256,), float("nan"), device=DEVICE)
    tail[: scale.numel()] = scale.flatten()
    return x.to(DEVICE, dtype), q.to(DEVICE), b, ref.to(DEVICE), tail[: scale.numel()].view(scale.shape)


def run(x, q, b, config, scale, group):
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    for buf in tg._SCRATCH.values():  # a split whose partial is never written fails
        buf.fill_(float("nan"))
    assert gemv(x, q, b, out=out, config=config, scale=scale, group_size=group) is out
    assert not out.isnan().any(), "output left unwritten"
    return out


def rel_error(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max())


# (N, K, group): K a multiple of the group; K = 200 and 576 (SmolLM2's hidden size) ending in a
# shorter group; group 16 (the smallest) with many groups per default tile.
SHAPES = [(24, 256, 16), (40, 200, 64), (37, 576, 128)]


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}g{g}" for n, k, g in SHAPES])
def test_grouped_gemv_matches_float32_product(shape, dtype, m):
    """The default config of the row bucket (fma for one row, tl.dot above), bias on odd m."""
    n, k, group = shape
    x, q, b, ref, scale = grouped_operands(m, n, k, group, dtype, m % 2 == 1, seed=m + k)
    out = run(x, q, b, tg.default_config(m), scale, group)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, ref) < BOUND[dtype]
    # The per-channel result of the same codes is far off: the group scales are really applied.
    per_row = gemv(x, q, b, config=tg.default_config(m), scale=scale[:, 0].contiguous())
    assert rel_error(per_row, ref) > 0.1


@pytest.mark.parametrize("config", tg.candidates(1, FP8), ids=str)
def test_grouped_every_fp8_candidate(config):
    """Every fp8 candidate (block_k capped to the group inside gemv, split-K included: each split
    covers whole groups, scaled before the splits are summed) on K = 1801 (odd; 15 groups of 128,
    the last of 9 columns)."""
    n, k, group = 40, 1801, 128
    for m in [1] if not config.dot else [1, 16]:
        x, q, b, ref, scale = grouped_operands(m, n, k, group, torch.bfloat16, m == 1, seed=k + m)
        assert rel_error(run(x, q, b, config, scale, group), ref) < BOUND[torch.bfloat16], m


def test_grouped_gemv_rejects_bad_groups():
    x = torch.randn(2, 64).to(DEVICE, torch.bfloat16)
    q = torch.randn(24, 64).to(FP8).to(DEVICE)
    ones = lambda *shape: torch.ones(*shape, device=DEVICE)  # noqa: E731
    bad = {
        "group not a power of two": (q, dict(scale=ones(24, 2), group_size=48)),
        "group below 16": (q, dict(scale=ones(24, 8), group_size=8)),
        "per-row scale with a group": (q, dict(scale=ones(24), group_size=32)),
        "too few groups": (q, dict(scale=ones(24, 1), group_size=32)),
        "strided scale": (q, dict(scale=ones(2, 24).T, group_size=32)),
        "group for a bf16 weight": (q.to(torch.bfloat16), dict(scale=ones(24, 2), group_size=32)),
    }
    for name, (w, kw) in bad.items():
        with pytest.raises(ValueError):
            gemv(x, w, **kw)
            pytest.fail(name)
    assert gemv(x, q, scale=ones(24, 2), group_size=32).shape == (2, 24)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_grouped_gemv_replays_in_a_cuda_graph():
    """A split-K grouped config captured once, replayed on a new input."""
    config = tg.FP8_DOT_EXTRA[1]  # split-K 4
    x, q, b, _, scale = grouped_operands(4, 2048, 2048, 128, torch.bfloat16, True, seed=13)
    out = torch.empty(4, 2048, dtype=torch.bfloat16, device=DEVICE)
    gemv(x, q, b, out=out, config=config, scale=scale, group_size=128)  # compile, scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, q, b, out=out, config=config, scale=scale, group_size=128)
    x.copy_(torch.randn(4, 2048, generator=torch.Generator().manual_seed(14)).to(DEVICE, x.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    deq = q.float() * scale.repeat_interleave(128, dim=1)
    assert rel_error(out, x.float() @ deq.T + b.float()) < BOUND[torch.bfloat16]
