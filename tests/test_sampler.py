"""Sampling (acceptance 6): seeded reproducibility, and temperature / top-k / top-p shape the
distribution as they should (statistical checks on a known distribution, not snapshots)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.sampler import sample
from worker.types import SamplingParams

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()
N = 4000


def draw(params: SamplingParams, n: int = N, seed: int = 0) -> torch.Tensor:
    logits = LOGITS.expand(n, -1).clone()
    gen = torch.Generator().manual_seed(seed)
    tokens, _ = sample(logits, [params] * n, [gen] * n)
    return torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).float() / n


def test_plain_sampling_follows_the_distribution():
    freq = draw(SamplingParams(temperature=1.0))
    # 4 standard errors of a binomial proportion at N draws.
    tol = 4 * (PROBS * (1 - PROBS) / N).sqrt()
    assert ((freq - PROBS).abs() <= tol).all(), (freq, PROBS)


def test_temperature_sharpens_and_flattens():
    cold, hot = draw(SamplingParams(temperature=0.3)), draw(SamplingParams(temperature=3.0))
    expect_cold = (LOGITS / 0.3).softmax(-1)
    assert abs(cold[0] - expect_cold[0]) < 0.03
    assert cold[0] > PROBS[0] + 0.2 and hot[0] < PROBS[0] - 0.1
    entropy = lambda p: float(-(p[p > 0] * p[p > 0].log()).sum())  # noqa: E731
    assert entropy(cold) < entropy(PROBS) < entropy(hot)


def test_top_k_and_top_p_truncate():
    freq = draw(SamplingParams(top_k=2))
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.4 / 0.65) < 0.03
    freq = draw(SamplingParams(top_p=0.7))  # 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15
    assert freq[3:].sum() == 0 and freq[2] > 0
    assert abs(freq[0] - 0.4 / 0.8) < 0.03


def test_greedy_and_logprobs():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=True)] * 3
    tokens, logprobs = sample(logits, params, [None] * 3)
    assert tokens == logits.argmax(-1).tolist()
    expect = logits.log_softmax(-1).max(-1).values
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(logprobs, expect.tolist()))


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0)
    runs = [
        [sample(logits, [p], [g])[0][0] for _ in range(20)]
        for g in (
            torch.Generator().manual_seed(7),
            torch.Generator().manual_seed(7),
            torch.Generator().manual_seed(8),
        )
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_engine_seed_reproducible_regardless_of_batch(make_engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Tell me a story."}])
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    engine = make_engine()
    [alone] = engine.generate([prompt], sp)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = engine.generate([prompt, prompt, prompt], [others, sp, others])
    assert batched[1] == alone
    [other_seed] = engine.generate([prompt], SamplingParams(**{**sp.__dict__, "seed": 99}))
    assert other_seed != alone


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_tokens=0),
        dict(temperature=float("nan")),
    ],
)
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
