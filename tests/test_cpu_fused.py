"""The "cpu" backend's fused small ops (worker/kernels/cpu_fused.py, cpu_fused.cpp) against the
torch formulas of worker/model/llama.py (RMSNorm, RotaryEmbedding, the MLP activation), which the
model runs without them: every dtype, strided views as the model passes them, enough rows to run
in parallel; bad arguments; and the served model's greedy tokens with and without the fused ops.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from worker.attention import get_attention_backend
from worker.kernels import cpu_ext, cpu_fused, reference
from worker.model.llama import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 200]  # 200 x 576 elements: past the serial threshold, cut across threads


@pytest.fixture(scope="module", autouse=True)
def op():
    cpu_ext.load()
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # the parallel cut runs on more than one thread
    yield
    torch.set_num_threads(old)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their dtype (0 = identical)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = a.contiguous().view(bits).to(torch.int64), b.contiguous().view(bits).to(torch.int64)
    same_sign = (ia >= 0) == (ib >= 0)
    assert bool(same_sign[(a != b)].all()), "a sign differs"
    return int((ia - ib).abs().max()) if a.numel() else 0


def torch_rms_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[1], eps).to(x.dtype)
    norm.weight.data.copy_(weight)
    if residual is None:
        return norm(x)
    summed = x + residual
    return norm(summed), summed


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 600, generator=g) * 3).to(dtype)[:, :576]  # strided rows, as a view
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    # The mean of 576 squares is summed in another order than torch's (float32's last places);
    # half types round that twice (the normalised value, then the product with the weight).
    tol = 64 if dtype == torch.float32 else 2
    assert ulps_apart(cpu_fused.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5)) <= tol
    out, summed = cpu_fused.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_summed = torch_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, ref_summed)  # one rounded add: exact
    assert ulps_apart(out, ref_out) <= tol


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(10 + rows)
    heads, kv_heads, dim = 9, 3, 64
    rope = RotaryEmbedding(dim, 4096, 100000.0, None)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)  # strided views, as the model has
    positions = torch.randint(0, 4096, (rows,), generator=g)
    q_out, k_out = cpu_fused.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    tables = rope.tables(positions)
    assert torch.equal(q_out, rope.apply(tables, q)) and torch.equal(k_out, rope.apply(tables, k))
    assert q_out.is_contiguous() and k_out.is_contiguous()


@pytest.mark.parametrize("cache_dtype", [None, torch.float32])  # None: k's dtype (the C++ path)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_matches_rope_then_store(dtype, rows, cache_dtype):
    """q_out and both caches equal RotaryEmbedding + reference.store_kv; padding slots (-1) write
    nothing; k and v stay as they were."""
    g = torch.Generator().manual_seed(30 + rows)
    heads, kv_heads, dim, blocks, block_size = 9, 3, 64, 40, 16
    rope = RotaryEmbedding(dim, 4096, 100000.0, None)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    slots[0] = -1  # a padding token
    shape = (blocks, block_size, kv_heads, dim)
    caches = [torch.randn(shape, generator=g).to(cache_dtype or dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    before = qkv.clone()
    q_out = cpu_fused.rope_store_kv(positions, q, k, v, rope.cos, rope.sin, *caches, slots)
    tables = rope.tables(positions)
    reference.store_kv(rope.apply(tables, k), v, *ref_caches, slots)
    assert torch.equal(q_out, rope.apply(tables, q))
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert torch.equal(qkv, before)


def test_rope_store_kv_rejects_a_slot_outside_the_cache():
    rope = RotaryEmbedding(8, 16, 10000.0, None)
    q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="slot 8 outside the cache"):
        cpu_fused.rope_store_kv(torch.tensor([3]), q, k, v, rope.cos, rope.sin, *caches, torch.tensor([8]))
    assert not caches[0].any() and not caches[1].any()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(20 + rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    # exp: ours (a polynomial) vs Sleef's (torch): float32's last places may differ; after
    # rounding to a half type the results are exact (every bf16 / fp16 value checked once).
    assert ulps_apart(cpu_fused.silu_and_mul(x), F.silu(gate) * up) <= (8 if dtype == torch.float32 else 0)


EXTREMES = [-math.inf, -200.0, -104.0, -103.0, -100.0, -89.0, -88.5, -87.0, -50.0, -1e-3, -0.0, 0.0]
EXTREMES += [1e-3, 5.0, 50.0, 88.5, 89.0, 100.0, math.inf, math.nan]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_ends_of_exp(dtype):
    """The vectorised exp's overflow (inf), underflow (0, denormals) and NaN: the same values as
    torch, including -0.0 where exp(-g) overflows and NaN for -inf and NaN (past the 16 or 8 lanes
    too: 20 values per row)."""
    gate = torch.tensor(EXTREMES, dtype=torch.float32)
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(dtype)
    ours = cpu_fused.silu_and_mul(x)
    ref = F.silu(x[:, : len(EXTREMES)]) * x[:, len(EXTREMES) :]
    assert torch.equal(ours.isnan(), ref.isnan()), (ours, ref)
    keep = ~ref.isnan()
    assert torch.equal(torch.signbit(ours[keep]), torch.signbit(ref[keep])), (ours, ref)
    assert ulps_apart(ours[keep], ref[keep]) <= (8 if dtype == torch.float32 else 0), (ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "cols", [1, 15, 16, 49152 + 7]
)  # one value, tails only, one block, SmolLM2's vocab + a tail
def test_argmax_rows_matches_torch(dtype, cols):
    """torch.argmax's answer on random rows (over a float64 copy: the same values), rows enough to
    run in parallel, and a strided view (every other row of a wider tensor)."""
    g = torch.Generator().manual_seed(cols)
    wide = (torch.randn(2 * 33, cols + 5, generator=g) * 4).to(dtype)
    for x in (wide[:, :cols], wide[::2, 3 : 3 + cols], wide[:1, :cols]):
        assert torch.equal(cpu_fused.argmax_rows(x), x.double().argmax(dim=-1)), (dtype, cols, x.stride())


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_ties_infinities_and_nan_as_torch(dtype):
    """The first maximum wins (ties within a 16-value block and across blocks); -inf rows give 0;
    +inf beats everything; a NaN counts as the maximum, the first one wins (torch's rule)."""
    n = 100
    rows = torch.full((7, n), -1.0)
    rows[0, [5, 17, 40]] = 3.0  # ties across blocks: 5
    rows[1, [20, 21, 30]] = 3.0  # ties in one block: 20
    rows[2] = float("-inf")  # every value -inf: 0
    rows[3, [50, 90]] = float("inf")
    rows[3, 10] = 1e30 if dtype != torch.float16 else 6e4  # inf beats the largest finite: 50
    rows[4, [33, 70]] = float("nan")
    rows[4, 2] = 5.0  # NaN beats 5: the first NaN, 33
    rows[5, 99] = float("nan")  # a NaN in the scalar tail: 99
    rows[6, 0] = 2.0  # the maximum first: 0
    x = rows.to(dtype)
    want = torch.tensor([5, 20, 0, 50, 33, 99, 0])
    assert torch.equal(x.float().argmax(dim=-1), want)  # torch's own answer, to be sure of the rule
    assert torch.equal(cpu_fused.argmax_rows(x), want)


def test_argmax_rows_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one column"):
        cpu_fused.argmax_rows(torch.empty(2, 0))
    with pytest.raises(ValueError, match=r"must be \[T, C\]"):
        cpu_fused.argmax_rows(torch.randn(8))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_fused.argmax_rows(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="columns must be contiguous"):
        cpu_fused.argmax_rows(torch.randn(8, 4).t())
    assert cpu_fused.argmax_rows(torch.empty(0, 5, dtype=torch.bfloat16)).shape == (0,)


def test_empty_batch():
    x = torch.empty(0, 576, dtype=torch.bfloat16)
    assert cpu_fused.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-5).shape == (0, 576)
    assert cpu_fused.silu_and_mul(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 4)


def test_rejects_bad_arguments():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight dtype"):
        cpu_fused.rms_norm(x, w.float(), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_fused.rms_norm(x, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="residual must match"):
        cpu_fused.rms_norm(x, w, 1e-5, torch.randn(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="columns must be contiguous"):
        cpu_fused.rms_norm(x.t(), torch.ones(2, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_fused.silu_and_mul(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[T, 2F\]"):
        cpu_fused.silu_and_mul(torch.ones(2, 7))
    rope = RotaryEmbedding(8, 16, 10000.0, None)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="position 16 outside the RoPE tables"):
        cpu_fused.rotary_embedding(torch.tensor([0, 16]), q, k, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="positions must be"):
        cpu_fused.rotary_embedding(torch.tensor([0, 1], dtype=torch.int32), q, k, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_fused.rotary_embedding(torch.tensor([0, 1]), q, k.bfloat16(), rope.cos, rope.sin)


def test_backend_fuses_half_types_only():
    cpu = torch.device("cpu")
    assert get_attention_backend("cpu", cpu, torch.bfloat16).fused is cpu_fused
    assert get_attention_backend("cpu", cpu, torch.bfloat16).rope_store_kv is cpu_fused.rope_store_kv
    assert get_attention_backend("cpu", cpu, torch.float16).fused is cpu_fused
    assert get_attention_backend("cpu", cpu, torch.float32).fused is None  # the reference path
    assert get_attention_backend("cpu", cpu).fused is None
    assert get_attention_backend("cpu", cpu, torch.float32).rope_store_kv is None


def test_torch_compile_traces_the_ops():
    """The fake implementations: a compiled function calling the ops matches eager."""
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)

    def f(x, w):
        out, summed = cpu_fused.rms_norm(x, w, 1e-5, x)
        act = cpu_fused.silu_and_mul(torch.cat([out, summed], dim=1))
        return act, cpu_fused.argmax_rows(act)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, w), f(x, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_served_model_greedy_tokens_with_and_without_fused_ops(tokenizer):
    """The CPU serving configuration (bfloat16, the GGUF's int4/int8 weights, the cpu backend): the
    same greedy tokens with the fused ops as with the torch formulas, through chunked prefill (with
    a cached prefix) and batched decode. With bfloat16 activations: int8 activations (the default
    on VNNI CPUs) round each 32-group to a step of max|x|/127, so a last-bit difference between the
    fused op and the torch formula can move a value across a rounding step and, a few tokens later,
    flip a near tie (measured: 1 token of 36 differed). The fused ops are exact either way; the
    int8 path is checked against float32 in tests/test_quant_smollm.py."""
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.model_runner import ModelRunner
    from worker.types import SamplingParams

    config = EngineConfig(
        device="cpu",
        dtype="bfloat16",
        quantization="auto",
        attention_backend="cpu",
        kv_cache_bytes=64 * 2**20,
        num_threads=1,
        enforce_eager=True,
        max_num_batched_tokens=48,
        cpu_int8_activations=False,
    )
    runner = ModelRunner(config)
    assert runner.backend.fused is cpu_fused and runner.backend.rope_store_kv is not None
    questions = [
        "What is the capital of France?",
        "Why is the sky blue? Answer in one sentence.",
        "What is the capital of France? Answer with one word.",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = LLMEngine(config, runner=runner).generate(prompts, params)
    assert runner.cpu_layers is not None  # the fused run went through the decoder-layer op
    runner.backend.fused = runner.backend.rope_store_kv = None
    runner.cpu_layers = None  # built on the fused ops: the plain run is the Python loop
    plain = LLMEngine(config, runner=runner).generate(prompts, params)
    assert fused == plain
