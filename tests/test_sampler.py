"""Sampling (acceptance 6): seeded reproducibility, and temperature / top-k / top-p shape the
distribution as they should (statistical checks on a known distribution, not snapshots)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from worker.sampling_ops import sample
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
    [other_seed] = engine.generate([prompt], dataclasses.replace(sp, seed=99))
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


# -- every sampling step against the pure-Python reference (worker/sampler_reference.py) --------

from worker.sampler_reference import (  # noqa: E402
    reference_adjusted,
    reference_choice,
    reference_sampling_logits,
    reference_top_logprobs,
)
from worker.sampling_ops import adjust_logits, penalty_state, record_tokens, sampling_logits  # noqa: E402
from worker.types import Logprob  # noqa: E402

VOCAB = 40
CASES = [
    dict(min_p=0.1),
    dict(min_p=0.5, temperature=0.7),
    dict(presence_penalty=1.5),
    dict(presence_penalty=-1.0),
    dict(frequency_penalty=0.8),
    dict(frequency_penalty=-2.0, presence_penalty=0.5),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.6),
    dict(logit_bias=((3, 5.0), (7, -100.0), (VOCAB - 1, 2.5))),
    dict(
        min_p=0.05, top_k=10, top_p=0.8, repetition_penalty=1.2, frequency_penalty=0.3, logit_bias=((0, 1.0),)
    ),
    dict(temperature=0, presence_penalty=2.0, logit_bias=((5, 3.0),)),
    dict(top_k=1, repetition_penalty=2.0),
]


def _history(rng: torch.Generator) -> tuple[list[int], list[int]]:
    prompt = torch.randint(0, VOCAB, (12,), generator=rng).tolist()
    output = torch.randint(0, VOCAB // 2, (9,), generator=rng).tolist()  # repeats: counts > 1
    return prompt, prompt + output


@pytest.mark.parametrize("case", CASES, ids=[",".join(sorted(c)) for c in CASES])
def test_sampling_steps_match_the_reference(case):
    rng = torch.Generator().manual_seed(11)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=rng) * 3
    params = [SamplingParams(**case)] * rows
    histories = [_history(rng) for _ in range(rows)]
    adjusted = adjust_logits(logits, params, histories)
    for i, (prompt, tokens) in enumerate(histories):
        expect = reference_adjusted(logits[i].tolist(), params[i], prompt, tokens)
        assert adjusted[i].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-5)
    if not params[0].greedy:
        final = sampling_logits(adjusted, params)
        for i in range(rows):
            expect = reference_sampling_logits(adjusted[i].tolist(), params[i])
            got = final[i].tolist()
            assert [x == float("-inf") for x in got] == [x == float("-inf") for x in expect]
            kept = [(a, b) for a, b in zip(got, expect) if b != float("-inf")]
            assert [a for a, _ in kept] == pytest.approx([b for _, b in kept], rel=1e-5, abs=1e-5)
    # The drawn tokens: the same per-row generators give the reference the same noise.
    gens = [torch.Generator().manual_seed(100 + i) for i in range(rows)]
    tokens, _ = sample(logits, params, gens, histories)
    for i, (prompt, tokens_so_far) in enumerate(histories):
        noise = torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(100 + i)).tolist()
        assert tokens[i] == reference_choice(logits[i].tolist(), params[i], prompt, tokens_so_far, noise)


def test_penalties_change_what_is_drawn():
    """Not vacuous: a strong presence penalty keeps greedy decoding off the tokens already output."""
    logits = torch.tensor([[5.0, 4.5, 4.0, 2.0]])
    history = [([3], [3, 0, 1])]
    plain, _ = sample(logits, [SamplingParams(temperature=0)], [None], history)
    penalized, _ = sample(logits, [SamplingParams(temperature=0, presence_penalty=2.0)], [None], history)
    biased, _ = sample(logits, [SamplingParams(temperature=0, logit_bias=((3, 100.0),))], [None])
    assert (plain, penalized, biased) == ([0], [2], [3])


def test_min_p_truncates_the_distribution():
    freq = draw(SamplingParams(min_p=0.5))  # keeps p >= 0.2: tokens 0 and 1
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.4 / 0.65) < 0.03


def test_top_logprobs_match_the_reference():
    rng = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=rng)
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=1.0, logprobs=True, top_logprobs=1, logit_bias=((9, 50.0),)),
    ]
    tokens, logprobs = sample(logits, params, [None, None, torch.Generator().manual_seed(1)])
    assert tokens[2] == 9  # the bias decides the draw, the logprobs stay those of the raw logits
    for i in (0, 2):
        assert isinstance(logprobs[i], Logprob)
        expect = reference_top_logprobs(logits[i].tolist(), params[i].top_logprobs)
        assert [t for t, _ in logprobs[i].top] == [t for t, _ in expect]
        assert [v for _, v in logprobs[i].top] == pytest.approx([v for _, v in expect], abs=1e-5)
        chosen = reference_top_logprobs(logits[i].tolist(), VOCAB)
        assert float(logprobs[i]) == pytest.approx(dict(chosen)[tokens[i]], abs=1e-5)
    assert not isinstance(logprobs[1], Logprob)


def test_penalties_without_history_are_refused():
    with pytest.raises(ValueError, match="history"):
        sample(torch.randn(1, 5), [SamplingParams(presence_penalty=1.0)], [None])


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0),
        dict(logit_bias=((1, 101.0),)),
        dict(top_logprobs=2),  # without logprobs
    ],
)
def test_invalid_new_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_mixed_batch_matches_the_reference_row_by_row():
    """Every case in one batch, with plain rows between them: the batched bias and penalty ops put
    each row's own adjustment in its own row."""
    rng = torch.Generator().manual_seed(5)
    params = [p for case in CASES for p in (SamplingParams(**case), SamplingParams())]
    logits = torch.randn(len(params), VOCAB, generator=rng) * 3
    histories = [_history(rng) for _ in params]
    adjusted = adjust_logits(logits, params, histories)
    for i, (prompt, tokens) in enumerate(histories):
        expect = reference_adjusted(logits[i].tolist(), params[i], prompt, tokens)
        assert adjusted[i].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-5), (i, params[i])
    gens = [torch.Generator().manual_seed(200 + i) for i in range(len(params))]
    tokens, _ = sample(logits, params, gens, histories)
    for i, (prompt, so_far) in enumerate(histories):
        noise = torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(200 + i)).tolist()
        assert tokens[i] == reference_choice(logits[i].tolist(), params[i], prompt, so_far, noise), i


def test_device_penalty_statistics_recorded_token_by_token_match_the_reference():
    """The model runner's path: statistics built from the prompt alone, then each sampled token
    recorded on the "device" (`record_tokens`); at every step the adjusted logits equal the
    pure-Python reference over the whole history, for every penalty kind in one batch (plain rows
    between, which record nothing)."""
    rng = torch.Generator().manual_seed(9)
    kinds = [c for c in CASES if SamplingParams(**c).needs_history]
    params = [p for case in kinds for p in (SamplingParams(**case), SamplingParams())]
    penalized = [i for i, p in enumerate(params) if p.needs_history]
    prompts = [torch.randint(0, VOCAB, (8,), generator=rng).tolist() for _ in params]
    states = list(penalty_state([(prompts[i], prompts[i]) for i in penalized], VOCAB, "cpu"))
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(12):
        logits = torch.randn(len(params), VOCAB, generator=rng) * 3
        adjusted = adjust_logits(logits, params, None, torch.stack(states))
        for i, p in enumerate(params):
            expect = reference_adjusted(logits[i].tolist(), p, prompts[i], prompts[i] + outputs[i])
            assert adjusted[i].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-5), (i, p)
        tokens = torch.randint(0, VOCAB // 3, (len(params),), generator=rng)  # repeats: counts > 1
        record_tokens(states, tokens[penalized])
        for i in penalized:
            outputs[i].append(int(tokens[i]))
    assert max(max(o.count(t) for t in o) for o in outputs if o) > 1
