"""Fused sampling: greedy, temperature, min-p, top-k, top-p and the exponential race in one Triton
kernel over the model-dtype logits, with no float32 `[S, V]` copy and no sort (issue 19, item 4).

Contract
- Input: `fused_sample(logits [S, V] bfloat16 / float16 / float32 (last dim contiguous; CUDA, or
  CPU under TRITON_INTERPRET=1), temperature [S] float32 >= 0, top_k [S] int32 (<= 0 or >= V = off),
  top_p [S] float32 in (0, 1] (1 = off), min_p [S] float32 in [0, 1] (0 = off), seeds [S] int64,
  offsets [S] int64, noise=None)`. Parameters are cast to those dtypes; everything is read on the
  device, so a CUDA graph can hold the launch.
- Output: tokens [S] int64, the semantics of worker/sampler.py `sample` without logit bias,
  penalties and logprobs: a row with temperature 0 or top_k 1 (`SamplingParams.greedy`) takes
  the argmax of its raw logits (first index on ties); any other row takes x = logits / T (float32,
  IEEE division), keeps the tokens with exp(x - max x) >= min_p (min-p: p >= min_p x max p), then
  the k largest, then the smallest set of most likely tokens whose mass reaches top_p (the first
  token always stays), and draws from the renormalised distribution by the exponential race:
  argmax over kept tokens of exp(x - max x) / E with E = -log(u), which draws exactly from it.
- Noise: u for token t of row r is Philox-4x32-10 keyed by seeds[r] (all 64 bits), counter
  (t, offsets[r] low 32 bits, offsets[r] high 32 bits, 0), first output word as Triton's
  `tl.rand` maps it to [0, 1). It depends on nothing else in the batch: the same (seed, offset)
  gives the same token in any batch, and each offset is a fresh, independent draw (the model
  runner passes offset = the number of tokens the request sampled so far). `noise` ([S, V] float32
  in (0, 1)) replaces the Philox draws; `philox_noise(seeds, offsets, V)` returns the draws the
  kernel makes.
- Thresholds without sorting: every truncation keeps an upper set {key >= t} of the row, key the
  order-preserving int32 image of the float32 x (bits, negatives with the low 31 bits flipped).
  Min-p: t = the smallest key it keeps. Top-k: the largest t with count(key >= t) >= k, i.e. the
  k-th largest key. Top-p: the largest t with mass(key >= t) >= top_p x the mass kept so far (a
  token stays iff the mass strictly above it is < top_p, as in the sort). Both come from a
  `probes`-ary search over the int32 key range: each pass over the row counts (sums) the tokens
  at or above `probes` evenly spaced keys at once and keeps the bracket holding the answer, so it
  is exact after at most ceil(32 / log2(probes)) passes (11 for the default 8).
- Ties: a threshold keeps every token tied with it in value, so a row with equal values at the
  k-th place (or at the top-p boundary) keeps more than the sort, which keeps exactly k (top-p:
  ties in sort order until the mass is reached). -0.0 and +0.0 are distinct keys. Sums run in a
  different order than the reference's cumsum, so a top-p boundary within float32 rounding
  (~1e-6 of the mass) of top_p, or a min-p ratio within an ulp of min_p, may fall the other way,
  and exp / log are Triton's (on a GPU a few ulp from torch's), so two race scores that close may
  order differently; tests use logits with distinct values. A Philox u of exactly 0 (2^-31) gives
  E = inf: that token cannot win.
- Cost: one program per row (grid S), tiles of `block` (default 512) elements, 8 warps. Passes
  over the row: 1 (max, first argmax, min; greedy rows stop here) + 1 if min-p + <= 11 if top-k
  (0 < k < tokens kept) + 1 + <= 11 if top-p + 1 (the race, with the Philox draws): 3 to 26 for
  the default 8 probes (pure bisection, probes=2: up to 32 per search). Each pass reads the row
  (2 x V bytes in bf16: from L2 while S x 2V fits there, 50 MB on an H100/H200) and costs per
  element the division and key (~5 ops), plus 2 x probes compares / adds in a search pass and an
  exp in a mass pass. No memory beyond the [S] output. One row is one program, so batch 1 runs
  on one SM (benchmarks/gpu_sampling.py measures it against the torch path). Compiled without a
  GPU (triton 3.9, worker/kernels/compile_check.py's `capture_launches`): sm_90 80 registers per
  thread, no spills, in every dtype; sm_80 64-80, with 32 bytes of spills in 3 of the 6 dtype /
  noise variants. The [block, probes] accumulators grow with both: probes 16 wants block 256.
- State: none. Fails how: ValueError on logits not 2-D / last dim not contiguous / dtype not
  bf16, fp16, fp32, parameter tensors not [S] on the logits' device, noise not [S, V], or probes
  not a power of two >= 2. NaN logits are undefined.
- Proven by tests/test_triton_sampling.py (CPU interpreter; CUDA with larger vocabularies): same
  tokens as `reference_fused_sample` (worker/kernels/reference.py `sampling_logits`, the torch
  sampler's math, + the race) for the same
  noise in every dtype and mix of rows; exact kept sets (a near-1 uniform on one token at a time),
  also 1e-5 (relative) either side of each top-p / min-p / top-k boundary; first index on ties;
  Philox draws are `tl.philox`'s and follow the truncated softmax; seed / offset reproducibility.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from worker.kernels import reference
from worker.types import SamplingParams

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _tile(base, offs, V, T):
    """A tile of the row: in-range mask, x = logits / T (IEEE division, as torch) in float32, and
    x's order-preserving int32 key (bits, negatives with the low 31 bits flipped)."""
    ok = offs < V
    x = tl.math.div_rn(tl.load(base + offs, mask=ok, other=0.0).to(tl.float32), T)
    bits = x.to(tl.int32, bitcast=True)
    return ok, x, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _search(base, V, T, m, lo, hi, target, MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    """The largest key t in [lo, hi] with f(t) >= target, f(t) = count (MASS: sum of exp(x - m)) of
    the row's keys >= t; f is non-increasing and f(lo) >= target is the caller's to ensure (if not,
    lo comes back). Each pass probes NP keys in (lo, hi] and keeps the bracket of the answer."""
    arange = tl.arange(0, BLOCK)
    j = tl.arange(0, NP).to(tl.int64) + 1
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        probe = lo + ((hi - lo) * j + (NP - 1)) // NP  # ceil; probe[NP - 1] == hi, probe[0] > lo
        pk = probe.to(tl.int32)
        if MASS:  # per-lane sums; one reduction per pass, after the loop
            acc = tl.zeros([BLOCK, NP], tl.float32)
        else:
            acc = tl.zeros([BLOCK, NP], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + arange
            ok, x, key = _tile(base, offs, V, T)
            ge = (key[:, None] >= pk[None, :]) & ok[:, None]
            if MASS:
                acc += tl.where(ge, tl.exp(x - m)[:, None], 0.0)
            else:
                acc += ge.to(tl.int32)
        f = tl.sum(acc, axis=0)
        # f is non-increasing along the probes (sums of non-negative terms over nested sets round
        # monotonically), so the probes that pass are a prefix: the answer lies in
        # [probe[J - 1], probe[J] - 1] (lo for J = 0, hi for J = NP).
        jj = tl.sum((f >= target).to(tl.int64), axis=0)
        width = hi - lo
        hi = tl.where(jj < NP, lo + (width * (jj + 1) + (NP - 1)) // NP - 1, hi)
        lo = lo + (width * jj + (NP - 1)) // NP
    return lo


@triton.jit
def _uniform(seed, offset, tokens):
    """Philox-4x32-10 (Triton's `tl.philox`, written out: nested jit calls are slow in the
    interpreter) keyed by the row's seed, counter (token, offset low, offset high, 0); the first
    word mapped to [0, 1) as `tl.rand` maps it."""
    c0 = tokens.to(tl.uint32)
    c2 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32) + c0 * 0
    c1 = (offset & 0xFFFFFFFF).to(tl.uint32) + c0 * 0
    c3 = c0 * 0
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        a0, a2 = c0, c2
        c0 = tl.math.umulhi(0xCD9E8D57, a2) ^ c1 ^ k0
        c2 = tl.math.umulhi(0xD2511F53, a0) ^ c3 ^ k1
        c1 = tl.mul(a2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(a0, 0xD2511F53, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    r = c0.to(tl.int32, bitcast=True)
    return tl.where(r < 0, ~r, r) * 4.6566127342e-10


@triton.jit
def _noise_kernel(seed_ptr, off_ptr, out_ptr, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    offset = tl.load(off_ptr + row)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        u = _uniform(seed, offset, offs)
        tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, u, mask=offs < V)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_l,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    seed_ptr,
    off_ptr,
    noise_ptr,
    stride_n,
    out_ptr,
    V,
    HAS_NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
    NP: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    arange = tl.arange(0, BLOCK)
    T = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    # Pass 1: max and first argmax of the raw logits, and their min.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + arange
        ok = offs < V
        lg = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32)
        upd = lg > best  # strict: each lane keeps its first index
        best = tl.where(upd, lg, best)
        best_idx = tl.where(upd, offs, best_idx)
        low = tl.minimum(low, tl.where(ok, lg, float("inf")))
    lmax = tl.max(best, axis=0)
    token = tl.min(tl.where(best == lmax, best_idx, V), axis=0)
    if (T != 0.0) & (k != 1):
        top_p = tl.load(topp_ptr + row)
        min_p = tl.load(minp_ptr + row)
        m = tl.math.div_rn(lmax, T)  # division is monotone: max(x) == max(logits) / T
        mb = m.to(tl.int32, bitcast=True)
        kmax = tl.where(mb >= 0, mb, mb ^ 0x7FFFFFFF)
        lb = tl.math.div_rn(tl.min(low, axis=0), T).to(tl.int32, bitcast=True)
        thr = tl.where(lb >= 0, lb, lb ^ 0x7FFFFFFF)
        kept = tl.zeros([], tl.int32) + V
        if min_p > 0.0:  # pass: the smallest key with exp(x - m) >= min_p, and how many pass
            kmin = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
            count = tl.zeros([BLOCK], tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + arange
                ok, x, key = _tile(base, offs, V, T)
                keep = ok & (tl.exp(x - m) >= min_p)
                kmin = tl.minimum(kmin, tl.where(keep, key, 0x7FFFFFFF))
                count += keep.to(tl.int32)
            thr = tl.min(kmin, axis=0)
            kept = tl.sum(count, axis=0)
        if (k > 0) & (k < kept):
            thr = _search(base, V, T, m, thr, kmax, k, False, BLOCK, NP).to(tl.int32)
        if top_p < 1.0:
            mass = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + arange
                ok, x, key = _tile(base, offs, V, T)
                mass += tl.where(ok & (key >= thr), tl.exp(x - m), 0.0)
            target = top_p * tl.sum(mass, axis=0)
            thr = _search(base, V, T, m, thr, kmax, target, True, BLOCK, NP).to(tl.int32)
        # The race over the kept tokens: argmax exp(x - m) / E, E = -log(u); first index on ties.
        seed = tl.load(seed_ptr + row)
        offset = tl.load(off_ptr + row)
        score = tl.full([BLOCK], -1.0, tl.float32)
        score_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + arange
            ok, x, key = _tile(base, offs, V, T)
            if HAS_NOISE:
                u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + offs, mask=ok, other=0.5)
            else:
                u = _uniform(seed, offset, offs)
            s = tl.where(ok & (key >= thr), tl.exp(x - m) / -tl.log(u), -1.0)
            upd = s > score
            score = tl.where(upd, s, score)
            score_idx = tl.where(upd, offs, score_idx)
        token = tl.min(tl.where(score == tl.max(score, axis=0), score_idx, V), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


@functools.cache
def default_warps(device: torch.device) -> int:
    """8 warps per row on sm_90 (80 registers, no spills); 4 below (8 spilled on sm_80 in bf16)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return 8
    return 4


def _rows(t: torch.Tensor, s: int, dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    if t.shape != (s,) or t.device != device:
        raise ValueError(f"{name} must be [{s}] on {device}, got {tuple(t.shape)} on {t.device}")
    return t.to(dtype).contiguous()


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    noise: torch.Tensor | None = None,
    *,
    probes: int = 8,
    block: int = 512,
    num_warps: int | None = None,
) -> torch.Tensor:
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype not in DTYPES:
        raise ValueError(f"logits must be 2-D bf16/fp16/fp32 with a contiguous last dim, got {logits.dtype}")
    if probes < 2 or probes & (probes - 1):
        raise ValueError(f"probes must be a power of two >= 2, got {probes}")
    s, v = logits.shape
    dev = logits.device
    args = [
        _rows(temperature, s, torch.float32, dev, "temperature"),
        _rows(top_k, s, torch.int32, dev, "top_k"),
        _rows(top_p, s, torch.float32, dev, "top_p"),
        _rows(min_p, s, torch.float32, dev, "min_p"),
        _rows(seeds, s, torch.int64, dev, "seeds"),
        _rows(offsets, s, torch.int64, dev, "offsets"),
    ]
    if noise is not None and (noise.shape != (s, v) or noise.device != dev or noise.stride(-1) != 1):
        raise ValueError(f"noise must be [{s}, {v}] on {dev} with a contiguous last dim")
    out = torch.empty(s, dtype=torch.int64, device=dev)
    if s:
        noise_arg = logits if noise is None else noise.float()
        block = min(triton.next_power_of_2(v), block)
        warps = num_warps or default_warps(dev)
        flags = dict(HAS_NOISE=noise is not None, BLOCK=block, NP=probes, num_warps=warps)
        _sample_kernel[(s,)](logits, logits.stride(0), *args, noise_arg, noise_arg.stride(0), out, v, **flags)
    return out


def philox_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms [S, vocab] float32 that `fused_sample` draws for these seeds and offsets."""
    s = seeds.shape[0]
    out = torch.empty(s, vocab, dtype=torch.float32, device=seeds.device)
    if s:
        seeds = _rows(seeds, s, torch.int64, seeds.device, "seeds")
        offsets = _rows(offsets, s, torch.int64, seeds.device, "offsets")
        block = min(triton.next_power_of_2(vocab), 1024)
        _noise_kernel[(s,)](seeds, offsets, out, vocab, out.stride(0), BLOCK=block)
    return out


def reference_fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Plain torch: worker/sampling_ops.py's path for these rows (float32 logits, greedy argmax,
    `reference.sampling_logits` with the steps the rows use, softmax, argmax p / E) with
    E = -log(noise). Tokens [S] int64. Its sort
    keeps exactly k tokens where values tie at the k-th place; `fused_sample` keeps all tied."""
    x = logits.float()
    tokens = x.argmax(dim=-1)
    params = [
        SamplingParams(temperature=float(t), top_k=max(int(k), 0), top_p=float(p), min_p=float(mp))
        for t, k, p, mp in zip(temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist())
    ]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        chosen = [params[i] for i in rows]
        truncated = any(p.top_k > 0 or p.top_p < 1.0 for p in chosen)  # as worker/sampling_ops.py
        probs = reference.sampling_logits(
            x[idx],
            temperature[idx].float(),
            min_p[idx].float() if any(p.min_p > 0 for p in chosen) else None,
            top_k[idx].clamp(min=0) if truncated else None,
            top_p[idx].float() if truncated else None,
        ).softmax(dim=-1)
        tokens[idx] = (probs / -noise[idx].float().log()).argmax(dim=-1)
    return tokens
