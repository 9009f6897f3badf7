"""Speculative decoding with n-gram drafts (worker/speculative.py) against decoding without drafts.

The proposer is checked against a plain-Python reference. Engines with drafts run the seeded
random workloads of tests/test_async_scheduling.py (arrivals and aborts between steps, EOS and stop
ids, max_tokens, greedy, seeded and penalized sampling, logprobs, priorities, prefix-cache hits,
pools small enough to preempt) beside an engine without drafts over the same runner: every request
ends with the same tokens, finish reason, counts and logprobs (aborted ones: the same tokens up to
the shorter; a drafted step can hand over several tokens before the abort lands), the scheduler's
integrity holds after every step, and every KV block is back at the end. Each test also asserts
that drafts were made, kept and rejected, so a disabled or always-rejecting path fails here.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from tests.test_async_scheduling import (
    TINY,
    Request,
    Result,
    random_workload,
    run,
    tiny_config,
    tiny_runner,
)
from worker.block_manager import BlockManager
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.speculative import NgramProposer, accepted_prefix
from worker.types import FinishReason, SamplingParams


def reference_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The proposer's rule in plain Python: the longest suffix n-gram (hi..lo) seen before, at its
    latest earlier occurrence followed by k tokens, else its latest; what followed it."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n :]
        ends = [e for e in range(n - 1, size - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            full = [e for e in ends if e + 1 + k <= size]
            e = (full or ends)[-1]
            return tokens[e + 1 : e + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_proposer_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        limit = rng.choice([None, 0, 1, 3, 10])
        want = reference_draft(tokens, k if limit is None else min(k, limit), lo, hi)
        assert NgramProposer(k, lo, hi).propose(tokens, limit) == want, (tokens, k, lo, hi, limit)


def test_proposer_examples():
    p = NgramProposer(3, 2, 3)
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([7, 8, 9, 5, 6, 7, 8]) == [9, 5, 6]  # "7 8" seen before: what followed it
    # The longer match wins over a later shorter one: "1 2 3" -> 4, not "2 3" -> 5.
    assert p.propose([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3]) == [4, 0, 2]
    assert p.propose([7, 8, 9, 5, 6, 7, 8], limit=1) == [9]
    # A repeating tail: the latest match with a whole draft after it, not the one just before the end.
    assert NgramProposer(4, 2, 2).propose([5, 5, 5, 5, 5, 5]) == [5, 5, 5, 5]
    assert NgramProposer(2, 1, 1, window=3).propose([4, 9, 9, 1, 2, 4]) == []  # 4 is outside the window
    for bad in ((0, 1, 1), (2, 0, 1), (2, 3, 2)):
        with pytest.raises(ValueError):
            NgramProposer(*bad)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accepted_prefix([5, 9, 7, 8], [5, 6, 7]) == 1
    assert accepted_prefix([4, 6], [5]) == 0


def spec_config(base: EngineConfig, k: int = 3) -> EngineConfig:
    return dataclasses.replace(base, num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)


class Census:
    """Wraps `Scheduler._take_drafted` on one engine: drafted steps that kept none, some, all of
    their draft, and those that ended their sequence before the sampled token."""

    def __init__(self, engine: LLMEngine):
        self.kept_none = self.kept_some = self.kept_all = self.cut = 0
        self.seeded = 0  # drafted steps of random (non-greedy) requests that rejected a draft token
        take = engine.scheduler._take_drafted

        def counting(seq, num_drafted, accepted, final, now):
            before = len(seq.token_ids)
            take(seq, num_drafted, accepted, final, now)
            kept = len(accepted)
            self.kept_none += kept == 0
            self.kept_some += 0 < kept < num_drafted
            self.kept_all += kept == num_drafted
            self.cut += len(seq.token_ids) - before < kept + 1
            self.seeded += not seq.sampling.greedy and kept < num_drafted

        engine.scheduler._take_drafted = counting


def assert_same_as_plain(plain: dict[str, Result], drafted: dict[str, Result], requests: list[Request]):
    for r in requests:
        want, got = plain[r.request_id], drafted[r.request_id]
        if want.finish_reason is FinishReason.ABORT and r.abort_at is not None:
            # Aborted once it had abort_at tokens: a drafted step may have handed over more first,
            # up to its end (max_tokens, a stop id) before the abort came.
            assert got.finish_reason is not None, r.request_id
            n = min(len(want.tokens), len(got.tokens))
            assert n >= min(r.abort_at, 1) and got.tokens[:n] == want.tokens[:n], r.request_id
            continue
        assert got.tokens == want.tokens, r.request_id
        assert got.finish_reason == want.finish_reason, r.request_id
        assert (got.num_prompt_tokens, got.num_output_tokens) == (
            want.num_prompt_tokens,
            want.num_output_tokens,
        ), r.request_id
        # The drafted rows are computed as a chunk: logprobs round differently from single decodes.
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5, rel=0), r.request_id


def plain_and_drafted(config: EngineConfig, requests: list[Request]) -> tuple[LLMEngine, Census, dict, dict]:
    runner = tiny_runner(config)
    plain = run(LLMEngine(config, runner=runner), requests)
    runner.sampler.seed_generator.manual_seed(config.seed)  # unseeded requests: the same seeds again
    engine = LLMEngine(spec_config(config), runner=runner)
    census = Census(engine)
    drafted = run(engine, requests)
    assert not runner.sampler.generators and not runner.sampler.penalties, "per-request state not released"
    return engine, census, plain, drafted


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_plain(seed):
    """Seeds alternate a roomy pool with one of 14 blocks (56 tokens) for up to 4 sequences, which
    preempts; prefix caching on and off."""
    small = seed % 2 == 1
    # the small pools' workloads are test_async_scheduling's preempting ones; penalties elsewhere
    requests = random_workload(100 + seed) if small else random_workload(300 + seed, penalties=True)
    config = tiny_config(num_kv_blocks=14 if small else 128, enable_prefix_caching=seed % 3 != 2)
    engine, census, plain, drafted = plain_and_drafted(config, requests)
    assert_same_as_plain(plain, drafted, requests)
    assert engine.stats().num_accepted_tokens > 0 and census.kept_all
    if small:
        assert engine.stats().num_preemptions > 0


def test_greedy_drafts_rejected_match_plain():
    """Prompts whose last token occurred before, followed by other tokens: the first drafts are
    what followed it, which the model does not say (this random model repeats itself); they are
    rejected, in part or whole, and the tokens and logprobs still equal the plain engine's."""
    rng = random.Random(11)
    requests = []
    for i in range(8):
        head = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(3, 8))]
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=i % 2 == 0, top_logprobs=2 * (i % 4 == 0))
        requests.append(Request(f"g{i}", head + head[:2], sp, arrive_after=3 * i, abort_at=None))
    engine, census, plain, drafted = plain_and_drafted(tiny_config(num_kv_blocks=128), requests)
    assert_same_as_plain(plain, drafted, requests)
    assert census.kept_none + census.kept_some > 0 and census.kept_all > 0


@pytest.mark.parametrize(
    "kept, final, output, stopped",
    [
        ([6], 99, [5, 6, 99], False),  # no stop id: every kept token and the sampled one
        ([6, 7], 8, [5, 6, 7], True),  # 7, a stop id, kept: what follows it is dropped
        ([6, 7, 8], 9, [5, 6, 7], True),
        ([], 7, [5, 7], True),  # the sampled token itself stops it
    ],
)
def test_stop_id_among_kept_drafts_ends_there(kept, final, output, stopped):
    """A drafted step whose kept tokens hold a stop id: the sequence ends at it (finish reason
    stop), the tokens after it are dropped, its blocks go back, usage counts what was output."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 4, 64, 128, eos_token_ids=(3,), proposer=NgramProposer(3, 1, 2), draft_max_batch=4)
    seq = Sequence("a", [9, 5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(7,)))
    sched.add(seq)
    plan = sched.schedule()  # the prompt
    sched.update(plan, {"a": (5, None)})
    plan = sched.schedule()  # "9 5" was seen before: the draft is what followed it
    [share] = plan.scheduled
    assert share.draft == (6, 7, 8) and share.num_new_tokens == 4 and plan.drafted == 1
    [out] = sched.update(plan, {"a": (final, None)}, {"a": [(t, None) for t in kept]})
    assert out.output_token_ids == output and sched.num_generation_tokens == len(output)
    assert sched.num_draft_tokens == 3 and sched.num_accepted_tokens == len(kept)
    if stopped:
        assert out.finish_reason is FinishReason.STOP and bm.num_free_blocks == 16
    else:
        assert not out.is_finished and out.num_computed_tokens == len(out.token_ids) - 1
    sched.check_integrity()


def test_seeded_sampling_rewinds_its_stream():
    """Random requests (temperature 1, seeded and unseeded) whose drafts are partly rejected: the
    rejected rows' draws are given back, so the tokens equal those sampled without drafts."""
    rng = random.Random(5)
    loop = [rng.randrange(TINY.vocab_size) for _ in range(6)]
    requests = [
        Request(
            f"s{i}",
            loop * 4 + [rng.randrange(TINY.vocab_size)],
            SamplingParams(temperature=t, seed=seed, max_tokens=40, ignore_eos=True, logprobs=True),
            arrive_after=i,
            abort_at=None,
        )
        for i, (t, seed) in enumerate([(3.0, 1), (5.0, 2), (4.0, None), (3.0, 3)])
    ]
    engine, census, plain, drafted = plain_and_drafted(tiny_config(num_kv_blocks=128), requests)
    assert_same_as_plain(plain, drafted, requests)
    assert census.seeded > 0 and engine.stats().num_accepted_tokens > 0


def test_drafting_stops_above_max_batch():
    """With more sequences running than speculative_max_batch (1 here), or any waiting, steps
    carry no drafts; once the two shorter requests are done, the last one drafts."""
    config = spec_config(tiny_config(num_kv_blocks=128, max_num_seqs=4))
    engine = LLMEngine(dataclasses.replace(config, speculative_max_batch=1), runner=tiny_runner(config))
    for i, n in enumerate((8, 8, 40)):
        engine.add_request(
            f"r{i}", [5, 6, 7] * 5, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
    plans = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        plans.append(plan := schedule(*args, **kwargs))
        return plan

    engine.scheduler.schedule = recording
    while engine.has_unfinished_requests():
        engine.step()
    assert all(p.drafted == 0 for p in plans if len(p.scheduled) > 1)
    assert any(p.drafted for p in plans)


def test_defaults_and_refusals(caplog):
    runner = tiny_runner(tiny_config())
    base = dataclasses.replace(tiny_config(), num_speculative_tokens=None)
    assert LLMEngine(base, runner=runner).scheduler.proposer is not None  # on by default on CPU
    assert LLMEngine(spec_config(base, 0), runner=runner).scheduler.proposer is None
    overlapped = LLMEngine(dataclasses.replace(base, async_scheduling=True), runner=runner)
    assert overlapped.scheduler.proposer is None
    overlapped.close()
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        explicit = LLMEngine(dataclasses.replace(spec_config(base), async_scheduling=True), runner=runner)
    explicit.close()
    assert explicit.scheduler.proposer is None and "speculative decoding is off" in caplog.text
    for bad in (
        dict(num_speculative_tokens=-1),
        dict(prompt_lookup_min=0),
        dict(prompt_lookup_min=4, prompt_lookup_max=3),
        dict(speculative_max_batch=0),
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(base, **bad)


COPY = (
    "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. "
    "Paris is the capital of France, and Berlin is the capital of Germany. Water boils at 100 degrees "
    "Celsius at sea level."
)


def test_real_model_copies_with_drafts(make_engine, tokenizer):
    """The embedded SmolLM2 (float32, the shared runner) asked to repeat a text: the same greedy
    tokens with drafts as without, most drafts kept, fewer steps."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": COPY}])
    sp = SamplingParams(temperature=0, max_tokens=48)
    plain = make_engine(num_speculative_tokens=0)
    want = plain.generate([prompt], sp)[0]
    engine = make_engine(num_speculative_tokens=4)
    assert engine.generate([prompt], sp)[0] == want
    stats = engine.stats()
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    assert engine.num_steps < plain.num_steps * 0.7


def test_verify_rewinds_the_fused_samplers_counter():
    """The fused sampler (CUDA's Triton kernel) draws row i of a request from Philox at the count
    of tokens it sampled so far: after a rejection the count is set back to just after the last
    row kept. A stand-in kernel that samples its counter as the token shows the counts."""
    from types import SimpleNamespace

    import torch

    from worker.sampler import RequestSampler

    def counter_as_token(logits, temperature, top_k, top_p, min_p, seed, counter):
        return counter % logits.shape[1]

    sampler = RequestSampler(torch.device("cpu"), 0, fused=counter_as_token)
    seq = SimpleNamespace(
        request_id="a", sampling=SamplingParams(temperature=1.0, seed=7), prompt_token_ids=[1]
    )
    rows = sampler.sample([seq] * 4, lambda upcast: torch.zeros(4, 16), drafted=True)
    assert rows.host_list() == [0, 1, 2, 3]  # counters 0..3
    out = sampler.verify(rows, {"a": (0, 1, 5)})  # rows 0 and 1 confirm 0 and 1; row 2 says 2
    assert out.to_host() == {"a": (2, None)} and out.accepted == {"a": [(0, None), (1, None)]}
    assert sampler.philox["a"][1] == 3  # three tokens out: the next draw is the fourth
    assert sampler.sample([seq], lambda upcast: torch.zeros(1, 16)).host_list() == [3]
