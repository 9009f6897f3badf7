"""RoPE + store_kv in one launch (worker/kernels/triton_rope_kv.py) against the two launches it
replaces (triton_norm.rotary_embedding, then triton_store_kv.store_kv), and the engine with it.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/triton_device.py).
Exactness: q_out and every cache byte must be identical to the pair's (`torch.equal` on the raw
bytes), including an fp8 e4m3 cache (both sides convert through the same device conversion: on
CPU the interpreter's, which tests/test_kernels.py notes rounds some bf16 values wrongly; on CUDA
the GPU's). The pair itself is checked against the torch formulas in tests/test_kernels.py; one
float32 case here also goes against them directly.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention_batches import BLOCK_SIZE
from tests.tiny_llama import TINY
from tests.triton_device import DEVICE
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kernels import reference, triton_norm, triton_store_kv
from worker.kernels.triton_rope_kv import rope_store_kv
from worker.model.llama import LlamaModel, RotaryEmbedding
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

FP8 = torch.float8_e4m3fn
NUM_BLOCKS, MAX_POS = 6, 64


def make_case(dtype, num_heads, num_kv_heads, head_dim, cache_dtype=None, num_tokens=7, seed=0):
    """q/k/v as the model has them (views into one fused q|k|v projection), positions, the
    RotaryEmbedding tables, random caches and slots with padding (-1) at tokens 1 and 5."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rope = RotaryEmbedding(head_dim, MAX_POS, 10000.0, None)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    if num_tokens > 5:
        slots[[1, 5]] = -1
    return dict(
        positions=torch.randint(0, MAX_POS, (num_tokens,), generator=gen).to(DEVICE),
        q=q.view(num_tokens, num_heads, head_dim),
        k=k.view(num_tokens, num_kv_heads, head_dim),
        v=v.view(num_tokens, num_kv_heads, head_dim),
        cos=rope.cos.to(DEVICE),
        sin=rope.sin.to(DEVICE),
        k_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, cache_dtype or dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, cache_dtype or dtype),
        slot_mapping=slots.to(DEVICE),
    )


def two_launches(case):
    """The pair the fused kernel replaces, on copies of the caches: (q_out, k_cache, v_cache)."""
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    q, k = triton_norm.rotary_embedding(case["positions"], case["q"], case["k"], case["cos"], case["sin"])
    triton_store_kv.store_kv(k, case["v"], k_cache, v_cache, case["slot_mapping"])
    return q, k_cache, v_cache


def fused(case, **kwargs):
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    args = {**case, "k_cache": k_cache, "v_cache": v_cache}
    return rope_store_kv(**args, **kwargs), k_cache, v_cache


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_padding_untouched(case, k_cache, v_cache):
    slots = case["slot_mapping"]
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    assert int(written.sum()) == int((slots >= 0).sum())
    for got, before in ((k_cache, case["k_cache"]), (v_cache, case["v_cache"])):
        assert same_bytes(got.flatten(0, 1)[~written], before.flatten(0, 1)[~written])
        assert not same_bytes(got, before)  # and the written rows did change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 2, 16), (6, 2, 24), (3, 3, 32), (8, 1, 10)],  # GQA, odd head counts / widths, MHA, MQA
)
def test_matches_two_launches(dtype, num_heads, num_kv_heads, head_dim):
    case = make_case(dtype, num_heads, num_kv_heads, head_dim, seed=num_heads * head_dim)
    want_q, want_k_cache, want_v_cache = two_launches(case)
    q_in, k_in, v_in = case["q"].clone(), case["k"].clone(), case["v"].clone()
    got_q, k_cache, v_cache = fused(case)
    assert same_bytes(got_q, want_q)
    assert same_bytes(k_cache, want_k_cache) and same_bytes(v_cache, want_v_cache)
    assert_padding_untouched(case, k_cache, v_cache)
    # Inputs are not modified (q, k, v are views into one projection output).
    assert same_bytes(case["q"], q_in) and same_bytes(case["k"], k_in) and same_bytes(case["v"], v_in)


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.bfloat16, FP8),
        (torch.float32, FP8),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_cache_of_another_dtype_matches_two_launches(dtype, cache_dtype):
    """--kv-cache-dtype fp8: rotated k is rounded to the activation dtype, then to the cache's, as
    the pair does. The interpreter's fp8 conversion rounds ties away from zero, so on CPU a kernel
    that skipped the first rounding would still pass the fp8 rows (on CUDA, ~3% of values differ:
    the rows grow there); the bf16 -> fp16 and fp16 -> fp32 caches catch it on CPU too."""
    tokens, heads, kv_heads, head_dim = (64, 8, 4, 64) if DEVICE == "cuda" else (7, 4, 2, 16)
    case = make_case(dtype, heads, kv_heads, head_dim, cache_dtype=cache_dtype, num_tokens=tokens, seed=3)
    want_q, want_k_cache, want_v_cache = two_launches(case)
    got_q, k_cache, v_cache = fused(case)
    assert same_bytes(got_q, want_q)
    assert same_bytes(k_cache, want_k_cache) and same_bytes(v_cache, want_v_cache)
    assert_padding_untouched(case, k_cache, v_cache)


def test_float32_matches_the_torch_formula():
    """Against the model's own torch RoPE and the reference store_kv (not only the Triton pair)."""
    case = make_case(torch.float32, 4, 2, 16, seed=5)
    cos_sin = (case["cos"][case["positions"]][:, None, :], case["sin"][case["positions"]][:, None, :])
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    k_rot = RotaryEmbedding.apply(cos_sin, case["k"])
    reference.store_kv(k_rot, case["v"], k_cache, v_cache, case["slot_mapping"])
    got_q, got_k_cache, got_v_cache = fused(case)
    q_rot = RotaryEmbedding.apply(cos_sin, case["q"])
    assert (got_q - q_rot).abs().max() <= 1e-6 * q_rot.abs().max()
    assert (got_k_cache - k_cache).abs().max() <= 1e-6 * k_cache.abs().max()
    assert torch.equal(got_v_cache, v_cache)


def test_given_q_out_and_empty_batch():
    case = make_case(torch.float16, 4, 2, 16, seed=7)
    want_q = two_launches(case)[0]
    q_out = torch.full_like(want_q, float("nan"))
    got_q = fused(case, q_out=q_out)[0]
    assert got_q is q_out and same_bytes(q_out, want_q)
    empty = make_case(torch.float16, 4, 2, 16, num_tokens=0)
    got_q, k_cache, v_cache = fused(empty)
    assert got_q.shape == (0, 4, 16)
    assert same_bytes(k_cache, empty["k_cache"]) and same_bytes(v_cache, empty["v_cache"])


def test_rejects_bad_arguments():
    case = make_case(torch.float32, 4, 2, 16)
    odd = dict(case, q=case["q"][..., :15], k=case["k"][..., :15], v=case["v"][..., :15])
    with pytest.raises(ValueError, match="rope_store_kv shapes"):  # odd head_dim: no rotate-half
        rope_store_kv(**odd)
    bad = {
        "v of another head count": dict(case, v=case["v"][:, :1]),
        "cos of another width": dict(case, cos=case["cos"][:, :4], sin=case["sin"][:, :4]),
        "caches of two dtypes": dict(case, v_cache=case["v_cache"].half()),
        "float slots": dict(case, slot_mapping=case["slot_mapping"].float()),
        "float positions": dict(case, positions=case["positions"].float()),
    }
    for why, args in bad.items():
        with pytest.raises(ValueError):
            rope_store_kv(**args)
            pytest.fail(why)
    for q_out in (case["q"], torch.empty_like(case["q"], dtype=torch.float16), torch.empty(7, 4, 8)):
        with pytest.raises(ValueError, match="q_out"):  # in place (overlapping q), dtype, shape
            rope_store_kv(**case, q_out=q_out)


def run_engine(two_launch: bool, kv_cache_dtype: str = "auto") -> tuple[list, dict, int]:
    """Greedy tokens and per-step logits of a tiny random Llama on the triton backend; with
    `two_launch` the backend's fused rope_store_kv is switched off (the path before it)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kv_cache_dtype == "fp8" else torch.float32
    model = LlamaModel(TINY).to(device=DEVICE, dtype=dtype).eval()
    config = EngineConfig(
        device=DEVICE,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        attention_backend="triton",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=2**19,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enforce_eager=True,
    )
    runner = ModelRunner.from_model(config, model)
    backend = runner.backend
    calls = [0]
    if two_launch:
        backend.rope_store_kv = None
    else:
        inner = backend.rope_store_kv

        def counted(*args):
            calls[0] += 1
            return inner(*args)

        backend.rope_store_kv = counted
    logits: dict[str, list[torch.Tensor]] = {}
    runner.logits_observer = lambda ids, rows: [
        logits.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)
    ]
    prompts = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [44, 12]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = LLMEngine(config, runner=runner).generate(prompts, sp)
    return tokens, logits, calls[0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_greedy_tokens_unchanged(kv_cache_dtype):
    """The whole engine on the triton backend: the fused launch is what runs (once per layer and
    step) and gives the two-launch path's tokens and logits exactly."""
    want_tokens, want_logits, _ = run_engine(True, kv_cache_dtype)
    tokens, logits, calls = run_engine(False, kv_cache_dtype)
    assert calls >= TINY.num_layers * 3  # prefill + 2 decode steps at least, every layer
    assert tokens == want_tokens
    assert logits.keys() == want_logits.keys()
    for rid, rows in logits.items():
        assert all(torch.equal(a, b) for a, b in zip(rows, want_logits[rid], strict=True)), rid
