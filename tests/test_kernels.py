"""Triton kernels vs their plain-torch references.

Attention and store_kv are checked against worker/kernels/reference.py; RMSNorm and RoPE against
the torch formulas of worker/model/llama.py, restated here.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/triton_device.py:
`TRITON_INTERPRET=1` is set by tests/conftest.py before triton's first import). CPU cases are kept
small (the interpreter runs each program in Python); with CUDA the parametrization grows to long
contexts and larger batches.

Relative error is max|a - b| / max|b| against the reference. Bounds: fp32 1e-5, fp16/bf16 1e-2.
Every output buffer is poisoned with NaN before the call, so a row the kernel forgets fails.
"""

import pytest
import torch

from tests import attention_batches
from tests.attention_batches import BLOCK_SIZE, TOLERANCE, rel_error
from tests.triton_device import DEVICE
from worker.kernels import reference, triton_attention, triton_norm, triton_store_kv

BATCHES = dict(attention_batches.BATCHES)
GQA = list(attention_batches.GQA)
HEAD_DIMS = [64, 128]
SPLITS = [1, 2, 4, 8]
if DEVICE == "cuda":
    BATCHES |= {
        "long_decode": [(n, 1) for n in (1, 15, 16, 17, 300, 1023, 2047, 4000)],
        "long_mixed": [(0, 333), (1500, 1), (700, 64), (2049, 1), (31, 200), (4096, 1)],
    }
    GQA += [(8, 1), (4, 4), (2, 16)]
    SPLITS += [16, 64]


def make_batch(*args, **kwargs):
    return attention_batches.make_batch(*args, device=DEVICE, **kwargs)


def run_triton(batch, **kwargs):
    out = torch.full_like(batch["q"], float("nan"))
    result = triton_attention.paged_attention(**batch, out=out, **kwargs)
    assert result is out
    assert not out.isnan().any(), "rows left unwritten"
    return out


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_paged_attention_matches_reference(kind, num_kv_heads, group, head_dim):
    batch = make_batch(BATCHES[kind], num_kv_heads, group, head_dim, torch.float32, seed=0)
    expected = reference.paged_attention(**batch)
    assert rel_error(run_triton(batch, num_splits=1), expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_paged_attention_half_precision(dtype, head_dim):
    batch = make_batch(BATCHES["mixed"], 2, 3, head_dim, dtype, seed=1)
    out = run_triton(batch)
    assert out.dtype == dtype
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[dtype]


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_paged_attention_block_layout_does_not_matter(seed):
    """Same logical K/V under different physical block permutations: same result, bit for bit."""
    seqs, num_kv_heads, group, head_dim = BATCHES["mixed"], 2, 3, 64
    batch = make_batch(seqs, num_kv_heads, group, head_dim, torch.float32, seed=seed)
    out = run_triton(batch, num_splits=1)
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]

    moved = dict(batch)
    perm = torch.randperm(batch["k_cache"].shape[0], generator=torch.Generator().manual_seed(seed))
    perm = perm.to(DEVICE)
    moved["k_cache"] = torch.empty_like(batch["k_cache"]).index_copy_(0, perm, batch["k_cache"])
    moved["v_cache"] = torch.empty_like(batch["v_cache"]).index_copy_(0, perm, batch["v_cache"])
    moved["block_tables"] = perm[batch["block_tables"].long()].to(torch.int32)
    assert torch.equal(run_triton(moved, num_splits=1), out)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("kind", ["decode", "mixed"] + (["long_decode"] if DEVICE == "cuda" else []))
def test_paged_attention_split_kv(kind, num_splits):
    batch = make_batch(BATCHES[kind], 2, 3, 64, torch.float32, seed=5)
    out = run_triton(batch, num_splits=num_splits)
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


def test_paged_attention_split_kv_bf16():
    batch = make_batch(BATCHES["decode"], 1, 8, 128, torch.bfloat16, seed=6)
    out = run_triton(batch, num_splits=4)
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.bfloat16]


def test_paged_attention_automatic_split_choice(monkeypatch):
    """A decode batch too small to fill the device, with long contexts, takes the split path."""
    seqs = BATCHES["long_decode"] if DEVICE == "cuda" else [(600, 1)]
    batch = make_batch(seqs, 1, 8, 128, torch.float16, seed=7)
    chosen, choose = [], triton_attention.choose_num_splits

    def recording_choose(*args):
        chosen.append(choose(*args))
        return chosen[-1]

    monkeypatch.setattr(triton_attention, "choose_num_splits", recording_choose)
    out = run_triton(batch)
    assert len(chosen) == 1 and chosen[0] > 1
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float16]


def test_paged_attention_per_sequence_split_count(monkeypatch):
    """A graph passes the longest context's max_seq_len: the split count is chosen for it, and each
    sequence skips the splits its own length does not need (fewer than MIN_SPLIT_LEN keys each).
    Scratch buffers start as NaN, so a skipped split's unwritten partial would poison the merge."""
    seqs = [(600, 1), (20, 1), (300, 1), (0, 1)]
    batch = make_batch(seqs, 1, 4, 64, torch.float32, seed=11)
    chosen, choose = [], triton_attention.choose_num_splits

    def recording_choose(*args):
        chosen.append(choose(*args))
        return chosen[-1]

    monkeypatch.setattr(triton_attention, "choose_num_splits", recording_choose)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 8)  # as if 8 SMs: 32 splits
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = run_triton(batch, max_query_len=1, max_seq_len=4096)
    assert chosen and chosen[0] > 600 // triton_attention.MIN_SPLIT_LEN  # more than any sequence uses
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


def test_paged_attention_host_lengths_and_odd_shapes():
    """Host-passed max lengths, head_dim 80 (padded inside), block size 8 (tiles span blocks)."""
    seqs = BATCHES["mixed"]
    batch = make_batch(seqs, 2, 2, 80, torch.float32, seed=8, block_size=8)
    out = run_triton(batch, max_query_len=max(n for _, n in seqs), max_seq_len=max(c + n for c, n in seqs))
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


def test_choose_num_splits():
    choose = triton_attention.choose_num_splits
    assert choose(num_seqs=4, num_kv_heads=2, max_query_len=8, max_seq_len=8192, num_sms=132) == 1
    # Enough (sequence, kv head) programs to fill 132 SMs: no split.
    assert choose(num_seqs=512, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 1
    assert choose(num_seqs=4, num_kv_heads=2, max_query_len=1, max_seq_len=100, num_sms=132) == 1
    # 8 programs on 132 SMs: split as far as the minimum split length allows.
    assert (
        choose(num_seqs=4, num_kv_heads=2, max_query_len=1, max_seq_len=2048, num_sms=132)
        == 2048 // triton_attention.MIN_SPLIT_LEN
    )
    assert (
        choose(num_seqs=1, num_kv_heads=1, max_query_len=1, max_seq_len=10**6, num_sms=132)
        == triton_attention.MAX_SPLITS
    )


def test_paged_attention_empty_batch():
    batch = make_batch([(3, 1)], 1, 2, 64, torch.float32, seed=9)
    batch["q"] = batch["q"][:0]
    batch["query_start_loc"] = torch.zeros_like(batch["query_start_loc"])
    assert triton_attention.paged_attention(**batch).shape == (0, 2, 64)


@pytest.mark.parametrize(
    "breakage",
    [
        "dtype",
        "kv_heads",
        "head_dim",
        "batch",
        "metadata_dtype",
        "strided_q",
        "num_splits",
        "out",
    ],
)
def test_paged_attention_rejects_bad_arguments(breakage):
    batch = make_batch(BATCHES["mixed"], 2, 3, 64, torch.float32, seed=10)
    kwargs = {}
    if breakage == "dtype":
        batch["q"] = batch["q"].half()
    elif breakage == "kv_heads":
        batch["q"] = batch["q"][:, :5]
    elif breakage == "head_dim":
        batch["k_cache"] = batch["k_cache"][..., :32]
    elif breakage == "batch":
        batch["seq_lens"] = batch["seq_lens"][:-1]
    elif breakage == "metadata_dtype":
        batch["block_tables"] = batch["block_tables"].float()
    elif breakage == "strided_q":
        batch["q"] = batch["q"].transpose(0, 2).contiguous().transpose(0, 2)
    elif breakage == "num_splits":
        kwargs["num_splits"] = 0
    elif breakage == "out":
        kwargs["out"] = torch.empty_like(batch["q"], dtype=torch.float16)
    with pytest.raises(ValueError):
        triton_attention.paged_attention(**batch, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv(dtype):
    gen = torch.Generator().manual_seed(11)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 12
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    # key/value are views into a fused qkv projection; some tokens are padding (slot -1).
    kv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    key = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    value = kv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[2, 7, 11]] = -1
    slot_mapping = slots.to(DEVICE)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    triton_store_kv.store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)

    written = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slot_mapping[slot_mapping >= 0]] = True
    assert written.sum() == num_tokens - 3
    assert torch.equal(k_cache.flatten(0, 1)[~written], before_k.flatten(0, 1)[~written])
    assert torch.equal(v_cache.flatten(0, 1)[~written], before_v.flatten(0, 1)[~written])


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_paged_attention_fp8_kv_cache(kind):
    """--kv-cache-dtype fp8: bf16 q over a float8_e4m3fn cache equals the reference over the same
    cache widened to bf16 (the widening is exact), within bf16 tolerance; split-KV too."""
    batch = make_batch(BATCHES[kind], 2, 3, 64, torch.bfloat16, seed=12)
    ref_batch = dict(batch)
    for name in ("k_cache", "v_cache"):
        fp8 = batch[name].to(torch.float8_e4m3fn)
        batch[name], ref_batch[name] = fp8, fp8.to(torch.bfloat16)
    expected = reference.paged_attention(**ref_batch)
    for num_splits in (1, 4):
        out = run_triton(batch, num_splits=num_splits)
        assert rel_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="the Triton interpreter rounds bf16 -> fp8 wrongly (1.953125 became 1.0, not 2.0); "
    "the GPU's conversion is what serves",
)
def test_store_kv_fp8_cache():
    """store_kv into a float8_e4m3fn cache rounds as torch's conversion does."""
    gen = torch.Generator().manual_seed(13)
    key = torch.randn(40, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(40, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    k_cache = torch.zeros(8, BLOCK_SIZE, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(8 * BLOCK_SIZE, generator=gen)[:40].to(DEVICE)
    triton_store_kv.store_kv(key, value, k_cache, v_cache, slots)
    for cache, src in ((k_cache, key), (v_cache, value)):
        got = cache.flatten(0, 1)[slots].float()
        assert torch.equal(got, src.to(torch.float8_e4m3fn).float())


def test_store_kv_rejects_bad_arguments():
    cache = torch.zeros(2, BLOCK_SIZE, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError):
        triton_store_kv.store_kv(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError):
        triton_store_kv.store_kv(key, key, cache, cache, slots[:2])
    with pytest.raises(ValueError):
        triton_store_kv.store_kv(key, key, cache, cache, slots.float())
    with pytest.raises(ValueError):
        triton_store_kv.store_kv(key.transpose(0, 2).contiguous().transpose(0, 2), key, cache, cache, slots)


def rms_norm_reference(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_reference(positions, x, cos, sin):
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm(dtype, with_residual):
    gen = torch.Generator().manual_seed(12)
    num_tokens, hidden = 5, 576  # SmolLM2's hidden size: not a power of two
    # x is a row-strided view, as a slice of a wider activation would be.
    x = torch.randn(num_tokens, 2 * hidden, generator=gen).to(DEVICE, dtype)[:, :hidden]
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    if with_residual:
        out, new_residual = triton_norm.rms_norm(x, weight, 1e-5, residual=residual)
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            # The interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest even.
            assert rel_error(new_residual, x + residual) < TOLERANCE[dtype]
        else:
            assert torch.equal(new_residual, x + residual)
        expected = rms_norm_reference(x + residual, weight, 1e-5)
    else:
        out = triton_norm.rms_norm(x, weight, 1e-5)
        expected = rms_norm_reference(x, weight, 1e-5)
    assert out.dtype == expected.dtype
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding(dtype):
    gen = torch.Generator().manual_seed(13)
    num_tokens, num_heads, num_kv_heads, head_dim, max_position = 7, 9, 3, 64, 100
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = triton_norm.rotary_embedding(positions, q, k, cos, sin)
    assert rel_error(q_out, rope_reference(positions, q, cos, sin)) < TOLERANCE[dtype]
    assert rel_error(k_out, rope_reference(positions, k, cos, sin)) < TOLERANCE[dtype]
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul(dtype):
    """The MLP activation in one kernel == the model's torch code, F.silu(gate) * up; a
    row-strided input (a slice of a wider activation), an intermediate size that is not a power of
    two and spans more than one block (1536: SmolLM2's), and an empty batch."""
    gen = torch.Generator().manual_seed(14)
    tokens, inter = 5, 1536
    x = (3 * torch.randn(tokens, 2 * inter + 8, generator=gen)).to(DEVICE, dtype)[:, : 2 * inter]
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = triton_norm.silu_and_mul(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    if dtype == torch.float32:
        assert rel_error(out, expected) < 1e-5
    elif DEVICE == "cuda":  # both round the SiLU, then the product: ulps apart at most (an H200
        # run, 2026-12-04: 2 of 7,680 float16 values one ulp apart, relative 1.5e-3)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out, expected, rtol=2 * eps, atol=eps)
    else:  # the interpreter truncates fp32 -> 16-bit casts (the GPU rounds): within one rounding
        assert rel_error(out, expected) < TOLERANCE[dtype]
    assert triton_norm.silu_and_mul(x[:0]).shape == (0, inter)
    with pytest.raises(ValueError):
        triton_norm.silu_and_mul(x[:, :7])  # odd width


def test_norm_kernels_reject_bad_arguments():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError):
        triton_norm.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError):
        triton_norm.rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, residual=x.half())
    q = torch.zeros(3, 4, 8, device=DEVICE)
    table = torch.zeros(10, 4, device=DEVICE)
    positions = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError):
        triton_norm.rotary_embedding(positions, q, q[:, :, :6], table, table)
    with pytest.raises(ValueError):
        triton_norm.rotary_embedding(positions.float(), q, q, table, table)
