"""Triton GEMV (worker/kernels/triton_gemv.py, tuning in worker/kernels/gemv_tuning.py), its model
pass (worker/model/gemv.py) and its benchmark (benchmarks/gpu_gemv.py); also the fp8-weight (W8A16)
form of the kernel that worker/model/fp8.py uses at decode (its model tests: tests/test_fp8.py).

Without CUDA the kernels run under the Triton interpreter (tests/triton_device.py); cases are small
there and grow on CUDA.

Error: max|out - ref| / max|ref| against the float32 product `x.float() @ W.float().T + b`. The
kernel accumulates in float32 and rounds once to the output dtype, so the bound is one rounding
of the output plus float32 accumulation error (< 1e-5 here): half an ulp on a GPU (bfloat16 2^-8,
float16 2^-11); the interpreter truncates float32 -> bfloat16 (a full ulp, 2^-7). float32: 1e-5.
Outputs (and the split-K scratch) are poisoned with NaN before each call, so anything the kernel
leaves unwritten fails. fp8 weights: the reference is the float32 product with the dequantized
weight, `x.float() @ (q.float() * scale[:, None]).T + b` (widening e4m3 is exact), same bounds.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn

from benchmarks import gpu_gemv
from tests import tiny_llama
from tests.triton_device import DEVICE
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kernels import gemv_tuning as gt
from worker.kernels import triton_gemv as tg
from worker.kernels.triton_gemv import FP8, GemvConfig, gemv
from worker.model.fp8 import quantize_fp8, quantize_model_fp8
from worker.model.gemv import GemvLinear, use_triton_gemv
from worker.model.llama import LlamaModel
from worker.model.quant import Int8Linear
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

HALF_ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11}
BOUND = {dt: u * (2 if dt == torch.bfloat16 and DEVICE == "cpu" else 1) + 1e-5 for dt, u in HALF_ULP.items()}
BOUND[torch.float32] = 1e-5
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ALL_CANDIDATES = tg.FMA_CANDIDATES + tg.DOT_CANDIDATES
# K = 1801 (odd) and 2048: every candidate runs exactly its split_k splits (checked below).
CANDIDATE_SHAPES = [(40, 1801), (72, 2048)] + ([(3072, 2048), (2048, 8192)] if DEVICE == "cuda" else [])
SHAPES = [(37, 203), (64, 512)] + ([(3072, 2048), (4000, 1500)] if DEVICE == "cuda" else [])
# Every row count on CUDA; on CPU (interpreted) each row bucket's edges and odd counts inside them.
ROWS = range(1, 17) if DEVICE == "cuda" else (1, 2, 3, 5, 8, 11, 16)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def operands(m, n, k, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x, w = x.to(DEVICE, dtype), w.to(DEVICE, dtype)
    b = b.to(DEVICE, dtype) if bias else None
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    return x, w, b, ref


def fp8_operands(m, n, k, dtype, bias, seed):
    """x in dtype, W quantized per row to e4m3 with float32 scales (rows of different ranges)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    q, scale = quantize_fp8(w, dim=1)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    x, q, scale = x.to(DEVICE, dtype), q.to(DEVICE), scale[:, 0].to(DEVICE)
    ref = x.float() @ (q.float() * scale[:, None]).T + (b.float() if bias else 0)
    return x, q, b, ref, scale


def case(fp8, *args):
    """(x, w, b, ref, scale): fp8_operands, or operands with no scale."""
    return fp8_operands(*args) if fp8 else (*operands(*args), None)


def run(x, w, b, config, scale=None):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    for buf in tg._SCRATCH.values():  # a split whose partial is never written fails
        buf.fill_(float("nan"))
    assert gemv(x, w, b, out=out, config=config, scale=scale) is out
    assert not out.isnan().any(), "output left unwritten"
    return out


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
def test_gemv_matches_float32_product(fp8, shape, dtype, bias, m):
    """Every row count 1..16 with the default config of its bucket (fma for M=1, tl.dot above);
    N and K not multiples of the blocks (and K not of 16), or all even. fp8: an e4m3 weight with
    per-row scales (W8A16), output in x's dtype, the same bound (widening is exact)."""
    x, w, b, ref, scale = case(fp8, m, *shape, dtype, bias, m + 100 * fp8)
    out = run(x, w, b, tg.default_config(m), scale=scale)
    assert out.dtype == dtype and out.shape == (m, shape[0])
    assert rel_error(out, ref) < BOUND[dtype]


# Every dense candidate, and for fp8 weights the same plus the deeper fp8 tiles.
CANDIDATE_CASES = [(c, False) for c in ALL_CANDIDATES] + [(c, True) for c in tg.candidates(1, FP8)]


@pytest.mark.parametrize(
    "config,fp8", CANDIDATE_CASES, ids=[f"{'fp8' if f else 'dense'}-{c}" for c, f in CANDIDATE_CASES]
)
@pytest.mark.parametrize("shape", CANDIDATE_SHAPES)
def test_every_candidate(shape, config, fp8):
    """Split-K included (fp8: the scale is applied once, after the splits are summed)."""
    n, k = shape
    assert tg.split_plan(k, config)[0] == config.split_k
    for m in [1] if not config.dot else [1, 5, 16]:
        for dtype in [torch.bfloat16, torch.float32]:
            x, w, b, ref, scale = case(fp8, m, n, k, dtype, m != 5, k + m)
            assert rel_error(run(x, w, b, config, scale=scale), ref) < BOUND[dtype], (m, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_weights_are_widened_exactly(dtype):
    """Every e4m3 value (NaNs as 0) in each row's column 4i, picked out by one-hot row i of x (in
    each of 4 K splits), scaled by powers of two: `out[i, n] = W[n, 4i] * scale[n]` exactly, in the
    fma and tl.dot paths and split-K (the interpreter's own fp8 conversion is checked here)."""
    n_idx, k_idx = torch.arange(256)[:, None], torch.arange(64)[None, :]
    bits = (n_idx + 16 * (k_idx // 4)) % 256  # W[n, 4i] = n + 16 i (mod 256)
    bits[(bits & 0x7F) == 0x7F] = 0  # the two NaN encodings
    q = bits.to(torch.uint8).view(FP8).to(DEVICE)  # [256, 64]
    scale = (2.0 ** (torch.arange(256) % 8 - 4)).to(DEVICE)
    expected = (q.float() * scale[:, None]).T[::4]  # [16, 256]: row i is column 4i
    assert len(q[:, 0].float().unique()) == 253  # 254 finite values, -0 == 0
    configs = (tg.DEFAULTS[False], tg.DEFAULTS[True], GemvConfig(16, 16, split_k=4, dot=True))
    configs += (GemvConfig(32, 16, split_k=4),)
    for config in configs:
        for m in [1] if not config.dot else [1, 16]:
            x = torch.zeros(m, 64)
            x[torch.arange(m), 4 * torch.arange(m)] = 1
            out = run(x.to(DEVICE, dtype), q, None, config, scale=scale)
            assert torch.equal(out.float(), expected[:m]), (config, m)


def test_split_k_is_deterministic_and_reuses_one_scratch_buffer():
    config = GemvConfig(32, 128, split_k=4, dot=True)
    outs, ptrs = [], set()
    for m in (1, 16, 3, 16):
        x, w, b, ref = operands(m, 48, 1000, torch.bfloat16, True, seed=7)
        outs.append(run(x, w, b, config))
        ptrs.add(tg._SCRATCH[(x.device, 4, 48)].data_ptr())
        assert rel_error(outs[-1], ref) < BOUND[torch.bfloat16]
    assert len(ptrs) == 1  # allocated once for 16 rows, never moved: a captured graph stays valid
    assert torch.equal(outs[1], outs[3])  # fixed-order reduction, no atomics


def test_strided_rows_and_out_view():
    gen = torch.Generator().manual_seed(3)
    wide_x = torch.randn(6, 300, generator=gen).to(DEVICE, torch.float16)
    w = torch.randn(50, 256, generator=gen).to(DEVICE, torch.float16)
    x = wide_x[:, 10:266]  # row stride 300, last dim contiguous
    buf = torch.full((6, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = buf[:, 7:57]
    gemv(x, w, out=out, config=tg.default_config(6))
    assert rel_error(out, x.float() @ w.float().T) < BOUND[torch.float16]
    assert buf[:, :7].isnan().all() and buf[:, 57:].isnan().all()  # nothing outside the view


def test_gemv_rejects_bad_inputs():
    x, w, _, _ = operands(2, 24, 32, torch.bfloat16, False, seed=0)
    bad = {
        "no rows": (x[:0], w, {}),
        "17 rows": (torch.cat([x] * 9)[:17], w, {}),
        "dtype": (x.half(), w, {}),
        "K": (x[:, :16], w, {}),
        "strided K": (x[:, ::2], w[:, :16], {}),
        "bias": (x, w, dict(bias=torch.zeros(23, dtype=x.dtype, device=DEVICE))),
        "out": (x, w, dict(out=torch.empty(2, 23, dtype=x.dtype, device=DEVICE))),
        "fma with 2 rows": (x, w, dict(config=GemvConfig(16, 64))),
        "fp8 without scale": (x, w.to(FP8), {}),
        "scale with bf16": (x, w, dict(scale=torch.ones(24, device=DEVICE))),
        "scale shape": (x, w.to(FP8), dict(scale=torch.ones(23, device=DEVICE))),
        "scale dtype": (x, w.to(FP8), dict(scale=torch.ones(24, dtype=x.dtype, device=DEVICE))),
        "fp8 x": (x.to(FP8), w.to(FP8), dict(scale=torch.ones(24, device=DEVICE))),
    }
    for name, (xi, wi, kw) in bad.items():
        with pytest.raises(ValueError):
            gemv(xi, wi, **kw)
            pytest.fail(name)
    with pytest.raises(ValueError):
        GemvConfig(8, 64, dot=True)  # tl.dot needs 16


def test_best_config():
    assert len(tg.candidates(1, FP8)) == len(tg.candidates(1)) + len(tg.FP8_FMA_EXTRA + tg.FP8_DOT_EXTRA)
    assert tg.candidates(2, FP8) == tg.DOT_CANDIDATES + tg.FP8_DOT_EXTRA
    if DEVICE == "cpu":  # no timing: the defaults, per bucket
        for wdt in (None, FP8):
            assert gt.best_config(1, 64, 64, torch.bfloat16, "cpu", wdt) == tg.DEFAULTS[False]
            assert gt.best_config(9, 64, 64, torch.bfloat16, "cpu", wdt) == tg.DEFAULTS[True]
            assert gt.tuning_times(1, 64, 64, torch.bfloat16, "cpu", wdt) == {}
        return
    for m in (1, 4):
        for wdt in (torch.bfloat16, FP8):  # one key per weight dtype, fp8 without F.linear
            config = gt.best_config(m, 2048, 2048, torch.bfloat16, DEVICE, wdt)
            times = gt.tuning_times(m, 2048, 2048, torch.bfloat16, DEVICE, wdt)
            linear = {"F.linear"} if wdt != FP8 else set()
            assert set(times) == linear | {str(c) for c in tg.candidates(m, wdt)}
            assert all(t > 0 for t in times.values())
            assert times[str(config)] == min(v for label, v in times.items() if label != "F.linear")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_gemv_replays_in_a_cuda_graph():
    """Split-K (scratch + reduction) and plain configs captured once, replayed on new inputs."""
    for config in (GemvConfig(64, 128, split_k=4, dot=True), GemvConfig(16, 256, split_k=2)):
        m = 1 if not config.dot else 8
        x, w, b, _ = operands(m, 2048, 2048, torch.bfloat16, True, seed=11)
        out = torch.empty(m, 2048, dtype=torch.bfloat16, device=DEVICE)
        gemv(x, w, b, out=out, config=config)  # before capture: compile, allocate the scratch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv(x, w, b, out=out, config=config)
        x.copy_(torch.randn(m, 2048, generator=torch.Generator().manual_seed(12)).to(DEVICE, x.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, x.float() @ w.float().T + b.float()) < BOUND[torch.bfloat16]
    config = tg.FP8_DOT_EXTRA[1]  # fp8 weight, split-K 4: the scale in the reduction
    x, q, b, _, scale = fp8_operands(4, 2048, 2048, torch.bfloat16, True, seed=13)
    out = torch.empty(4, 2048, dtype=torch.bfloat16, device=DEVICE)
    gemv(x, q, b, out=out, config=config, scale=scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, q, b, out=out, config=config, scale=scale)
    x.copy_(torch.randn(4, 2048, generator=torch.Generator().manual_seed(14)).to(DEVICE, x.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = x.float() @ (q.float() * scale[:, None]).T + b.float()
    assert rel_error(out, ref) < BOUND[torch.bfloat16]


# --- the model pass --------------------------------------------------------------------------

TINY = dataclasses.replace(tiny_llama.TINY, tie_embeddings=False)
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41], [44, 12, 3, 90, 7]]  # 13 prompt rows, then 2 per decode
MAX_TOKENS = 6


def tiny_model(dtype=torch.bfloat16) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(TINY).to(device=DEVICE, dtype=dtype).eval()


def run_engine(model: LlamaModel, graphs: bool = False) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Greedy tokens and the sampled rows' logits; `graphs` (CUDA): decode rows replay CUDA graphs
    recorded by the runner, with the model (and any GemvLinear in it) as it is now."""
    on_gpu = dict(gpu_memory_utilization=0.02, max_model_len=256) if DEVICE == "cuda" else {}
    config = EngineConfig(
        device=DEVICE,
        kv_cache_bytes=2**21,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        attention_backend="triton" if graphs else "torch",
        enforce_eager=not graphs,
        **on_gpu,
    )
    runner = ModelRunner.from_model(config, model)
    logits: dict[str, list[torch.Tensor]] = {}
    runner.logits_observer = lambda ids, rows: [
        logits.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)
    ]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = LLMEngine(runner.config, runner=runner).generate(PROMPTS, sp)
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


# The repo's bfloat16 bound (tests/attention_batches.py TOLERANCE); measured 5.3e-3 on CPU: logits
# after two layers whose every projection may differ from F.linear's by one rounding.
MODEL_BOUND = 1e-2


@pytest.mark.parametrize("max_rows", [16, 12])
def test_forced_model_pass_gives_the_same_logits(max_rows):
    """max_rows 16: the 13-row prompt step and the 2-row decode steps run the kernel; max_rows 12:
    the prompt step falls back to F.linear (the counters say which path ran)."""
    ref_tokens, ref_logits = run_engine(tiny_model())
    model = tiny_model()
    assert use_triton_gemv(model, max_rows=max_rows, force=True) == 4 * TINY.num_layers
    tokens, logits = run_engine(model)
    assert tokens == ref_tokens
    for rid, ref in ref_logits.items():
        assert rel_error(logits[rid], ref.float()) < MODEL_BOUND, rid
    swapped = [m for m in model.modules() if isinstance(m, GemvLinear)]
    assert len(swapped) == 4 * TINY.num_layers
    decode_steps = MAX_TOKENS - 1
    for m in swapped:
        prefill_gemv = max_rows >= sum(map(len, PROMPTS))
        assert m.gemv_calls == decode_steps + prefill_gemv
        assert m.linear_calls == (not prefill_gemv)
    assert all(r["use"] and r["gemv_us"] is None for r in model.triton_gemv_report)


def test_model_pass_leaves_quantized_fp32_and_head_alone():
    model = tiny_model()
    layer0 = model.layers[0]
    for parent, name in [(layer0.self_attn, "qkv_proj"), (layer0.mlp, "down_proj")]:
        dense = getattr(parent, name)
        setattr(parent, name, Int8Linear.from_float(dense.weight.float().cpu()).to(DEVICE))
    before = {name: mod for name, mod in model.named_modules()}
    assert use_triton_gemv(model, force=True) == 4 * TINY.num_layers - 2
    assert model.layers[0].self_attn.qkv_proj is before["layers.0.self_attn.qkv_proj"]
    assert model.layers[0].mlp.down_proj is before["layers.0.mlp.down_proj"]
    assert type(model.lm_head) is nn.Linear and model.lm_head is before["lm_head"]
    assert use_triton_gemv(model, force=True) == 0  # already swapped
    fp8 = tiny_model()
    quantize_model_fp8(fp8)
    assert use_triton_gemv(fp8, force=True) == 0
    assert use_triton_gemv(tiny_model(torch.float32), force=True) == 0
    with pytest.raises(ValueError):
        use_triton_gemv(tiny_model(), max_rows=17)


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the pass times and swaps")
def test_model_pass_does_nothing_on_cpu_unless_forced():
    model = tiny_model()
    assert use_triton_gemv(model) == 0
    assert not any(isinstance(m, GemvLinear) for m in model.modules())


@pytest.mark.skipif(DEVICE != "cuda", reason="the timing decision needs CUDA")
def test_model_pass_timed_on_cuda():
    model = tiny_model()
    swapped = use_triton_gemv(model)
    report = model.triton_gemv_report
    assert {(r["n"], r["k"]) for r in report} == {(128, 64), (64, 64), (256, 64), (64, 128)}
    assert all(r["use"] == (r["gemv_us"] < r["linear_us"]) for r in report)
    winners = {(r["n"], r["k"]) for r in report if r["use"]}
    per_shape = {(128, 64): 2, (64, 64): 2, (256, 64): 2, (64, 128): 2}  # one per layer
    assert swapped == sum(per_shape[s] for s in winners)
    forced = tiny_model()  # the kernel in every bucket, whatever the timing said
    assert use_triton_gemv(forced, force=True) == 4 * TINY.num_layers
    for graphs in (False, True):  # with graphs: the swapped modules are captured and replayed
        ref_tokens, ref_logits = run_engine(tiny_model(), graphs)
        for m in (model, forced):
            tokens, logits = run_engine(m, graphs)
            assert tokens == ref_tokens
            for rid, ref in ref_logits.items():
                assert rel_error(logits[rid], ref.float()) < MODEL_BOUND, (graphs, rid)
    assert all(m.gemv_calls > 0 for m in forced.modules() if isinstance(m, GemvLinear))


# --- the benchmark ---------------------------------------------------------------------------


def test_gemv_bench_smoke():
    from benchmarks.gpu_bench import LLAMA_1B

    assert gpu_gemv.shapes_of(LLAMA_1B) == gpu_gemv.LLAMA_1B_SHAPES
    shapes = gpu_gemv.SMOKE_SHAPES if DEVICE == "cpu" else gpu_gemv.LLAMA_1B_SHAPES[:1]
    rows = gpu_gemv.gemv_bench(DEVICE, shapes=shapes, rows=(1, 3), fp8=True)
    kinds = ("dense", "fp8")
    assert [(r["shape"], r["kind"], r["rows"]) for r in rows] == [
        (s[0], kind, m) for s in shapes for kind in kinds for m in (1, 3)
    ]
    for r in rows:
        assert r["gemv_us"] > 0 and r["cublas_us"] > 0 and r["gemv_rel_err"] < BOUND[torch.bfloat16]
        assert r["weight_bytes"] == (2 if r["kind"] == "dense" else 1) * r["n"] * r["k"]
    for r in (r for r in rows if r["kind"] == "fp8"):  # W8A8 also rounds x to e4m3: larger error
        assert r["w8a8_us"] > 0 and r["gemv_rel_err"] < r["w8a8_rel_err"] < 0.1
    assert [t["rows"] for t in gpu_gemv.fp8_step_totals(rows)] == [1, 3]
    text = gpu_gemv.rows_to_markdown(rows, bandwidth_gbs=4492.0)
    assert text.count("\n| qkv_proj |") == 4 and "Per decode step" in text and "FP8 per decode step" in text


def test_choose_buckets_keeps_the_kernel_only_where_it_was_faster(monkeypatch):
    """The timed decision both model passes share (gemv_tuning.choose_buckets), with fake timings
    (on CPU nothing is timed): a bucket gets the GEMV only where it beat the path it replaces."""
    cfg = {b: tg.default_config(b) for b in (1, 2, 4)}
    gemv_us = {1: 5.0, 2: 9.0, 4: 20.0}
    monkeypatch.setattr(gt, "best_config", lambda m, n, k, dtype, device, wd=None, g=0: cfg[m])
    monkeypatch.setattr(
        gt, "tuning_times", lambda m, n, k, dtype, device, wd=None, g=0: {str(cfg[m]): gemv_us[m]}
    )
    baseline = ("linear", {1: 6.0, 2: 8.0, 4: 25.0}.__getitem__)
    configs, rows, notes = gt.choose_buckets(8, 8, torch.bfloat16, torch.device("cpu"), (1, 2, 4), baseline)
    assert configs == {1: cfg[1], 4: cfg[4]}
    assert [(r["rows"], r["gemv_us"], r["linear_us"], r["use"]) for r in rows] == [
        (1, 5.0, 6.0, True),
        (2, 9.0, 8.0, False),
        (4, 20.0, 25.0, True),
    ]
    assert len(notes) == 3
    forced, rows, notes = gt.choose_buckets(8, 8, torch.bfloat16, "cpu", (1, 2), baseline, force=True)
    assert forced == {1: tg.default_config(1), 2: tg.default_config(2)} and not notes
    assert all(r["use"] and r["gemv_us"] is None for r in rows)
