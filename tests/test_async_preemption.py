"""Preemption while a step is in flight (async scheduling: worker/scheduler.py, worker/engine.py).

The engine runs over `FakeRunner`, a model runner without a model, as the slow reference of what a
real one must see: a sampled token is a hash of the sequence's whole prefix (`next_token`), so a
wrong input, a lost or repeated token changes every token after it; it keeps a simulated KV cache
(per slot: the salt and the prefix whose last token wrote it) and checks, at every step, each
context position the step reads against it, so a block reused while its owner still needed it, or
a prefix-cache hit on a block another sequence wrote, fails there; and it counts each request's
sampled tokens as a sampler's per-request state does (penalty statistics, generators): a
`runner.release` of a sequence that goes on, or a count that skips, fails too. Every output is
checked against the request's reference continuation (`expected`), whatever the scheduling, the
scheduler's integrity after every step, and at the end every block is back in the pool and every
request released exactly once.

Targeted cases, each made to happen and asserted to have happened: a victim whose pending token is
EOS (it finishes from the waiting queue), a victim re-admitted (with a prefix-cache hit), an abort
of a victim, a higher-priority arrival preempting during overlap, a failing step rolled back with a
victim in it; then random workloads (hypothesis) through both engines.
tests/test_async_ends_in_flight.py uses this runner for sequences that end (EOS, abort) while a
step in flight holds them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampler import SampledTokens
from worker.scheduler import SchedulerOutput
from worker.sequence import PLACEHOLDER
from worker.types import FinishReason, SamplingParams

VOCAB, EOS, BS = 16, 3, 4


def next_token(request_id: str, prefix: tuple[int, ...]) -> int:
    """The fake model: a function of the prefix (request_id lets a test force one token)."""
    return hash(prefix) % VOCAB


class FakeRunner:
    """ModelRunner's interface (launch / run / release), checked as described above."""

    def __init__(self, num_blocks: int, token_fn=next_token):
        self.model_config = SimpleNamespace(vocab_size=VOCAB, max_position=1024)
        self.num_blocks, self.eos_token_ids, self.model_name = num_blocks, (EOS,), "fake"
        self.device = torch.device("cpu")
        self.token_fn = token_fn
        self.kv: dict[int, tuple] = {}  # slot -> (salt, prefix up to the token it holds)
        self.sampled: dict[str, int] = {}  # request id -> tokens sampled (the sampler's state)
        self.released: list[str] = []
        self.launches = 0
        self.fail_at: set[int] = set()  # launches (counted from 0) that raise: a failing step

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.sampled.pop(request_id, None)

    def run(self, plan: SchedulerOutput):
        return self.launch(plan).to_host()

    def launch(self, plan: SchedulerOutput, prev=None, feeds=frozenset()) -> SampledTokens:
        self.launches += 1
        if self.launches - 1 in self.fail_at:
            raise RuntimeError("injected")
        rows, tokens = [], []
        for s in plan.scheduled:
            seq, rid, end = s.seq, s.seq.request_id, s.start + s.num_new_tokens
            if rid in feeds:  # the token of the step before, read where it was sampled
                new = [int(prev.tokens[prev.row(rid)])]
            else:
                new = seq.token_ids[s.start : end]
            prefix = tuple(seq.token_ids[: s.start]) + tuple(new)
            assert len(prefix) == end and PLACEHOLDER not in prefix, f"{rid}: input not known"
            table = s.block_table[: s.num_blocks]
            for p in range(s.start, end):
                self.kv[table[p // BS] * BS + p % BS] = (seq.salt, prefix[: p + 1])
            for p in range(end):
                held = self.kv.get(table[p // BS] * BS + p % BS)
                assert held == (seq.salt, prefix[: p + 1]), f"{rid}: KV at position {p} is not its own"
            if s.samples:
                n = self.sampled.get(rid, 0)
                assert n == end - seq.num_prompt_tokens, f"{rid}: sampler state {n} at {end} tokens"
                self.sampled[rid] = n + 1
                rows.append(rid)
                tokens.append(self.token_fn(rid, prefix))
        return SampledTokens(rows, torch.tensor(tokens, dtype=torch.int64))


def expected(prompt: list[int], sp: SamplingParams, max_model_len: int, rid: str, token_fn=next_token):
    """The reference continuation and its finish reason (no abort)."""
    tokens = list(prompt)
    while True:
        token = token_fn(rid, tuple(tokens))
        tokens.append(token)
        if (token == EOS and not sp.ignore_eos) or token in sp.stop_token_ids:
            return tokens[len(prompt) :], FinishReason.STOP
        if len(tokens) - len(prompt) >= sp.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt) :], FinishReason.LENGTH


def make_engine(num_blocks: int, async_scheduling: bool = True, token_fn=next_token, **kw) -> LLMEngine:
    config = EngineConfig(
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_num_seqs=kw.pop("max_num_seqs", 4),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 32),
        async_scheduling=async_scheduling,
        enable_prefix_caching=kw.pop("prefix", True),
        num_speculative_tokens=0,  # its FakeRunner computes one token per sequence per step
        **kw,
    )
    engine = LLMEngine(config, runner=FakeRunner(num_blocks, token_fn))
    engine.plans = []
    schedule = engine.scheduler.schedule

    def recording(speculative: bool = False):
        plan = schedule(speculative)
        victims = [(s.request_id, s.num_placeholders) for s in plan.preempted]  # pending tokens
        engine.plans.append((speculative, victims, plan))
        return plan

    engine.scheduler.schedule = recording
    return engine


class Driver:
    """Steps an engine, collecting outputs; integrity after every step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}

    def add(self, rid: str, prompt: list[int], sp: SamplingParams, priority: int = 0) -> None:
        self.engine.add_request(rid, prompt, sp, priority)
        self.prompts[rid] = (prompt, sp)
        self.tokens[rid] = []

    def step(self) -> dict[str, object]:
        outs = {o.request_id: o for o in self.engine.step()}
        for o in outs.values():
            assert o.request_id not in self.finished, f"{o.request_id}: output after its last"
            self.tokens[o.request_id] += o.new_token_ids
            if o.finished:
                self.finished[o.request_id] = o.finish_reason
        self.engine.scheduler.check_integrity()
        return outs

    def drain(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        engine = self.engine
        assert not engine.has_unfinished_requests(), "did not finish"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.block_manager.check_integrity([])
        assert not engine.scheduler.pinned
        assert sorted(engine.runner.released) == sorted(self.tokens), "released once each"
        assert not engine.runner.sampled
        limit = engine.info.max_model_len
        for rid, (prompt, sp) in self.prompts.items():
            want, reason = expected(prompt, sp, limit, rid, engine.runner.token_fn)
            if self.finished[rid] is FinishReason.ABORT:
                assert self.tokens[rid] == want[: len(self.tokens[rid])], rid
            else:
                assert (self.tokens[rid], self.finished[rid]) == (want, reason), rid
        engine.close()


def speculative_victims(engine: LLMEngine) -> list[tuple[str, int]]:
    """(request id, tokens it had pending) of each sequence preempted while a step was in flight."""
    return [victim for spec, victims, _ in engine.plans if spec for victim in victims]


def two_in_three_blocks(token_fn=next_token, **kw) -> Driver:
    """a and b, one block each of 3: the plan made while their prompts run gives a its second
    block and must preempt b (newest), which has its first token pending."""
    d = Driver(make_engine(3, token_fn=token_fn, **kw))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    d.add("a", [1, 2, 3, 4], sp)
    d.add("b", [5, 6, 7, 8], SamplingParams(max_tokens=6))
    return d


def test_victim_whose_pending_token_is_eos_finishes_from_the_waiting_queue():
    d = two_in_three_blocks(lambda rid, prefix: EOS if rid == "b" else next_token(rid, prefix))
    outs = d.step()
    assert speculative_victims(d.engine) == [("b", 1)]
    b = outs["b"]
    assert b.finished and b.finish_reason is FinishReason.STOP and b.new_token_ids == [EOS]
    assert b.num_preemptions == 1  # synchronously it would have ended before the plan (none)
    assert "b" not in d.engine.scheduler.requests and not d.engine.scheduler.waiting
    assert d.engine.block_manager.num_free_blocks == 1  # b's block, freed once
    d.drain()
    assert d.engine.num_sync_steps == 1 and not d.engine.fallbacks


def five_blocks() -> Driver:
    """a (4-token prompt) and b (8 tokens: 2 blocks, hashed once computed) in 5 blocks: when a
    needs its third block, b (newest) is preempted with its 5th token pending (plan 5)."""
    d = Driver(make_engine(5))
    d.add("a", [1, 2, 3, 4], SamplingParams(max_tokens=9, ignore_eos=True))
    d.add("b", [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=9, ignore_eos=True))
    return d


def test_victim_is_readmitted_once_its_token_is_known_with_a_prefix_hit():
    """Once a ends, b comes back: its prompt blocks from the prefix cache, the rest recomputed."""
    d = five_blocks()
    while not speculative_victims(d.engine):
        d.step()
    assert speculative_victims(d.engine) == [("b", 1)]
    b = d.engine.scheduler.requests["b"]
    # The step in flight when b was preempted has committed: b's token from it is out, b waits.
    assert b in d.engine.scheduler.waiting and not b.block_table and not b.num_placeholders
    assert d.tokens["b"] == b.output_token_ids and b.num_output_tokens == 5
    d.drain()
    starts = [s.start for _, _, p in d.engine.plans for s in p.scheduled if s.seq is b]
    back = next(k for k in range(1, len(starts)) if starts[k] < starts[k - 1])
    assert starts[:back] == [0, 8, 9, 10, 11] and starts[back] == 8, "no prefix hit on re-admission"
    assert d.engine.num_sync_steps == 1 and not d.engine.fallbacks


def test_failing_step_with_a_victim_rolls_back():
    """The step b has its token pending in fails (the 5th launch): every launched plan is undone,
    b, preempted by the plan launched behind it, waits with nothing computed (not the count the
    failed step started from), and the engine goes on to the reference tokens."""
    d = five_blocks()
    d.engine.runner.fail_at = {4}
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(6):
            d.step()
    assert speculative_victims(d.engine) == [("b", 1)]
    b = d.engine.scheduler.requests["b"]
    assert b.num_placeholders == 0 and b.num_computed_tokens == 0 and not b.block_table
    assert b.num_output_tokens == 4  # the failed step's token is gone
    d.engine.scheduler.check_integrity()
    d.drain()


def test_pending_last_tokens_free_blocks_before_anyone_is_preempted():
    """a's pending token is its last (max_tokens 1): when c needs a block, a's are freed (as the
    synchronous engine, which has finished a by then, would have them) and nobody is preempted."""
    d = Driver(make_engine(4))
    d.add("a", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    d.add("b", [5, 6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True))
    d.add("c", [9, 10, 11, 12], SamplingParams(max_tokens=5, ignore_eos=True))
    outs = d.step()
    assert outs["a"].finished and outs["a"].num_preemptions == 0
    assert [s.seq.request_id for s in d.engine.plans[1][2].scheduled] == ["b", "c"]
    d.drain()
    assert d.engine.scheduler.num_preemptions == 0 and not speculative_victims(d.engine)


def test_abort_of_a_preempted_victim():
    d = two_in_three_blocks()
    d.step()
    assert speculative_victims(d.engine) == [("b", 1)] and len(d.tokens["b"]) == 1
    assert d.engine.abort("b")
    outs = d.step()
    assert outs["b"].finish_reason is FinishReason.ABORT and outs["b"].new_token_ids == []
    d.drain()


def test_abort_while_the_victims_token_is_pending_drops_it():
    """At the scheduler: the victim is aborted between the plan that preempted it and the commit
    of the step that samples its token: the token is dropped, no block freed twice."""
    engine = make_engine(3)
    s = engine.scheduler
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4], sp)
    engine.add_request("b", [5, 6, 7, 8], sp)
    first = s.schedule()
    s.advance(first)
    s.in_flight.append(first)
    second = s.schedule(speculative=True)
    assert [x.request_id for x in second.preempted] == ["b"]
    b = s.requests["b"]
    s.check_integrity()
    s.abort("b")
    assert b.token_ids == [5, 6, 7, 8] and b.is_finished and not b.block_table
    touched = s.commit(first, {"a": (9, None), "b": (10, None)})
    assert touched == [s.requests["a"]] and b.output_token_ids == []
    s.in_flight.clear()
    s.check_integrity()
    assert engine.block_manager.num_free_blocks == 1  # a holds 2 of 3
    engine.close()


def test_higher_priority_arrival_preempts_during_overlap():
    d = Driver(make_engine(4))
    d.add("low", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    d.step()
    d.step()
    low = d.engine.scheduler.requests["low"]
    assert d.engine.has_in_flight and low in d.engine.scheduler.pinned
    d.add("high", [9] * 9, SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    outs = d.step()  # its plan, made while low's step runs, preempts low for high
    assert speculative_victims(d.engine) == [("low", 1)] and "low" in outs
    assert any(s.seq.request_id == "high" for s in d.engine.plans[-1][2].scheduled)
    d.drain()
    assert d.engine.num_sync_steps == 1
    assert d.finished["high"] is FinishReason.LENGTH


request = st.tuples(
    st.integers(1, 14),  # prompt length
    st.integers(2, 16),  # max_tokens
    st.integers(0, 2),  # priority
    st.integers(0, 3),  # arrives after this many steps
    st.sampled_from([None, None, None, None, None, 1, 4]),  # aborted once it has this many tokens
    st.booleans(),  # ignore_eos
)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(request, min_size=2, max_size=8),
    num_blocks=st.integers(5, 12),
    max_num_seqs=st.integers(2, 4),
    budget=st.integers(4, 24),
    prefix=st.booleans(),
)
def test_random_workloads_with_preemption(requests, num_blocks, max_num_seqs, budget, prefix):
    """Both engines, every output checked against the reference; small pools preempt."""
    for async_scheduling in (False, True):
        d = Driver(
            make_engine(
                num_blocks,
                async_scheduling,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                prefix=prefix,
            )
        )
        limit = d.engine.info.max_model_len
        pending = list(enumerate(requests))
        for step in range(500):
            for i, (n, max_tokens, priority, after, _, ignore_eos) in list(pending):
                if after <= step:
                    prompt = [1 + (i + k) % 2 for k in range(min(n, limit - 1))]  # shared prefixes
                    d.add(
                        f"r{i}",
                        prompt,
                        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                        priority,
                    )
                    pending.remove((i, requests[i]))
            if not pending and not d.engine.has_unfinished_requests():
                break
            d.step()
            for i, (*_, abort_at, _) in enumerate(requests):
                rid = f"r{i}"
                if rid in d.tokens and rid not in d.finished and abort_at is not None:
                    if len(d.tokens[rid]) >= abort_at:
                        assert d.engine.abort(rid)
        d.drain()
