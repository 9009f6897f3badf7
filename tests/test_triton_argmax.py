"""The two-pass Triton argmax (worker/kernels/triton_argmax.py) against torch.argmax, and its use
for plain-greedy batches in worker/sampler.py.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/triton_device.py);
rows stay short there and small chunks (16, 32) give many chunks per row; CUDA adds 32k and 128k
rows at the default chunk. Every case must equal `logits.argmax(dim=-1)` exactly (torch's rule:
first index of the maximum, NaN above everything, first NaN).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE
from worker.kernels.triton_argmax import argmax, default_chunk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (vocab, chunk): one partial chunk, several with a ragged tail, exact multiples, the default chunk.
SHAPES = [(5, 16), (100, 16), (128, 32), (1000, None), (1500, 64)]
if DEVICE == "cuda":
    SHAPES += [(32000, None), (128256, None), (128256, 4096)]


def check(logits: torch.Tensor, chunk=None) -> torch.Tensor:
    got = argmax(logits, chunk)
    want = logits.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,chunk", SHAPES)
def test_random_rows(dtype, vocab, chunk):
    gen = torch.Generator().manual_seed(vocab)
    for rows in (1, 3):
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE, dtype)
        check(logits, chunk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_within_and_across_chunks(dtype):
    vocab, chunk = 100, 16
    logits = torch.zeros(5, vocab, dtype=dtype, device=DEVICE)
    logits[0, [40, 17, 99]] = 3.0  # across chunks: the first (17, chunk 1) wins
    logits[1, [33, 34, 47]] = 2.0  # within chunk 2 (32..47): 33
    logits[2, [15, 16]] = 1.0  # either side of a chunk boundary: 15
    logits[3, [96, 99]] = 7.0  # only in the ragged last chunk
    logits[4] = -1.0  # a constant row: 0
    got = check(logits, chunk)
    assert got.tolist() == [17, 33, 15, 96, 0]
    # The same maximum in every chunk, at the chunk's last position: the first chunk's.
    row = torch.full((1, vocab), -5.0, dtype=dtype, device=DEVICE)
    row[0, chunk - 1 :: chunk] = 1.0
    assert check(row, chunk).tolist() == [chunk - 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_and_signed_zero(dtype):
    inf = float("inf")
    logits = torch.full((5, 70), -inf, dtype=dtype, device=DEVICE)
    logits[1, 50] = -3.0  # one finite value among -inf
    logits[2, [20, 60]] = inf  # +inf: the first
    logits[3, 5], logits[3, 40] = -0.0, 0.0  # equal: the first, whatever its sign
    logits[3, :5] = -1.0
    logits[4, 69] = -inf  # all -inf (row 0 too): 0
    got = check(logits, 16)
    assert got.tolist() == [0, 50, 20, 5, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_counts_as_the_maximum(dtype):
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 90, generator=gen).to(DEVICE, dtype)
    logits[0, 77] = nan  # one NaN, in a later chunk than the finite maximum: still wins
    logits[1, [50, 12, 85]] = nan  # several, in several chunks: the first
    logits[2, 3], logits[2, 4] = inf, nan  # NaN beats +inf
    logits[3] = nan  # all NaN: 0
    got = check(logits, 16)
    assert got.tolist() == [77, 12, 4, 0]


def test_strided_rows_and_empty_batch():
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 200, generator=gen).to(DEVICE, torch.bfloat16)
    check(wide[:, :130], 32)  # rows 200 apart, 130 long
    assert argmax(wide[:0]).shape == (0,)


def test_default_chunk():
    assert default_chunk(1) == default_chunk(128256) == 1024  # 126 chunks for Llama 3
    assert default_chunk(151936) == 2048 and default_chunk(10**9) == 16384


def test_rejects_bad_arguments():
    x = torch.zeros(2, 64, device=DEVICE)
    for bad in (x[0], x[:, :0], x.double(), x.to(torch.int32), x.t()):
        with pytest.raises(ValueError):
            argmax(bad)
    for chunk in (0, 8, 48):
        with pytest.raises(ValueError, match="chunk"):
            argmax(x, chunk)


def test_sampler_uses_it_for_plain_greedy_batches():
    """RequestSampler's plain-greedy path: the Triton argmax on CUDA, and (set by hand here, as
    on CUDA) under the interpreter: same tokens as torch, from the model-dtype logits."""
    from worker.sampler import RequestSampler
    from worker.types import SamplingParams

    sampler = RequestSampler(DEVICE, seed=0)
    assert (sampler.greedy_argmax is argmax) == (DEVICE == "cuda")
    calls = []
    sampler.greedy_argmax = lambda logits: calls.append(logits.dtype) or argmax(logits, 32)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 300, generator=gen).to(DEVICE, torch.bfloat16)
    seqs = [_Seq(f"r{i}", SamplingParams(temperature=0, max_tokens=4)) for i in range(3)]
    upcast = []
    tokens = sampler.sample(seqs, lambda up: upcast.append(up) or (logits.float() if up else logits))
    assert calls == [torch.bfloat16] and upcast == [False]
    assert torch.equal(tokens.tokens, logits.argmax(dim=-1))
    # A batch with a sampled row does not take it.
    seqs[1] = _Seq("r1", SamplingParams(temperature=0.7, max_tokens=4))
    sampler.sample(seqs, lambda up: logits.float() if up else logits)
    assert calls == [torch.bfloat16]


class _Seq:
    def __init__(self, request_id, sampling):
        self.request_id, self.sampling, self.prompt_token_ids = request_id, sampling, [1, 2]
