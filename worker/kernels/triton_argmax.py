"""Two-pass Triton argmax over the vocabulary: greedy decoding's token choice, spread over many
programs (torch's CUDA argmax reduces a 128k-token row in one block: 36 us per step on an H200).

Contract:
- Input: `argmax(logits [S, V], chunk=None)`: logits bfloat16, float16 or float32, last dim
  contiguous (any row stride), S >= 0, V >= 1, on CUDA (or CPU under TRITON_INTERPRET=1).
  `chunk` (a power of two; default `default_chunk(V)`) is how many tokens one pass-1 program
  reads.
- Output: tokens [S] int64, equal to `logits.argmax(dim=-1)`: the first index of the row's
  maximum on ties (also between chunks); NaN counts as larger than everything (the first NaN wins,
  as in torch); an all -inf row gives 0; -0.0 and +0.0 are equal.
- Passes: pass 1, grid (S, ceil(V / chunk)): each program reads one chunk of one row, in float32
  (exact for all three dtypes), and writes its (max, first index of the max) to a scratch buffer
  (a chunk with a NaN writes (NaN, first NaN)). Pass 2, grid (S): one program per row reduces
  the chunk results the same way; since chunk order is index order, the first best chunk holds
  the first best index.
- Scratch and graphs: 8 bytes per (row, chunk), allocated per call from torch's caching allocator
  as one tensor (under CUDA-graph capture that is the graph's private pool, so the captured
  pointers stay valid on replay; nothing is kept between calls). No host sync.
- Cost: V x dtype bytes read once; about ceil(V / chunk) programs per row (126 for a 128,256
  vocabulary at the default chunk 1024), then S programs of ceil(V / chunk) entries.
- State: none. Fails how: ValueError for logits not 2-D, V == 0, another dtype, a last dim that is
  not contiguous, or a chunk that is not a power of two >= 16.
- Proven by tests/test_triton_argmax.py (interpreter on CPU; CUDA adds 32k and 128k rows): equal
  to torch.argmax in every dtype, for vocabularies not a multiple of the chunk, ties inside and
  across chunks, -inf and all -inf rows, NaN (one, several, in several chunks), strided rows.
  Used by worker/sampler.py for plain-greedy batches on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_CHUNKS = 128  # the default chunk keeps a row to about this many pass-1 programs


def default_chunk(vocab: int) -> int:
    """Tokens per pass-1 program: 1024 for vocabularies up to ~128k (126 programs per row for
    Llama 3's 128,256: about one wave on 132 SMs at batch 1), larger beyond, at most 16384."""
    return min(16384, max(1024, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS))))


@triton.jit
def _best(x, idx, valid):
    """(max, first index of the max) of the valid entries of x, float32; NaN beats everything
    (then the first NaN's index). Entries past `valid` must hold idx values larger than any
    valid one (their position in the row is used)."""
    is_nan = (x != x) & valid
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    xm = tl.where(valid, x, float("-inf"))
    m = tl.max(tl.where(is_nan, float("-inf"), xm), 0)
    hit = tl.where(has_nan, is_nan, valid & (xm == m))
    first = tl.min(tl.where(hit, idx, 2147483647), 0)
    return tl.where(has_nan, float("nan"), m), first


@triton.jit
def _argmax_chunk_kernel(logits_ptr, vals_ptr, idx_ptr, stride_row, vocab, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    best, first = _best(x, cols, valid)
    tl.store(vals_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _argmax_reduce_kernel(vals_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    valid = c < num_chunks
    vals = tl.load(vals_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + c, mask=valid, other=2147483647)
    _, first = _best(vals, idx, valid)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax(logits: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax needs logits [S, V] with V >= 1, got {tuple(logits.shape)}")
    if logits.dtype not in DTYPES:
        raise ValueError(f"argmax logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError(f"argmax needs the last dim contiguous, strides {logits.stride()}")
    rows, vocab = logits.shape
    if vocab >= 2**31 - 1:
        raise ValueError(f"argmax: vocabulary {vocab} does not fit int32 indices")
    chunk = default_chunk(vocab) if chunk is None else chunk
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"argmax chunk must be a power of two >= 16, got {chunk}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, chunk)
    scratch = torch.empty(2, rows * num_chunks, dtype=torch.int32, device=logits.device)
    vals, idx = scratch[0].view(torch.float32), scratch[1]
    _argmax_chunk_kernel[(rows, num_chunks)](
        logits,
        vals,
        idx,
        logits.stride(0),
        vocab,
        num_chunks,
        CHUNK=chunk,
        num_warps=4 if chunk <= 2048 else 8,
    )
    _argmax_reduce_kernel[(rows,)](
        vals, idx, out, num_chunks, CHUNKS_PAD=max(16, triton.next_power_of_2(num_chunks))
    )
    return out
