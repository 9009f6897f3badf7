"""Property tests of the block manager and scheduler (pure Python, no model).

Acceptance 3: random add / step / abort sequences (with preemption forced by tiny pools) keep
`check_integrity()` true after every operation, and every block is free once all requests end;
with n-gram drafts (random parts of each kept), no sequence holds a block its tokens do not need
once a step is taken (a rejected draft's blocks go back).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.block_manager import BlockManager, token_bytes
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.speculative import NgramProposer
from worker.types import FinishReason, SamplingParams

EOS = 0


def fake_step(sched: Scheduler, rng: random.Random) -> list[Sequence]:
    plan = sched.schedule()
    accepted = {
        s.seq.request_id: [(t, None) for t in s.draft[: rng.randint(0, len(s.draft))]]
        for s in plan.scheduled
        if s.draft
    }
    assert plan.num_batched_tokens <= sched.max_num_batched_tokens
    assert len({id(s.seq) for s in plan.scheduled}) == len(plan.scheduled)
    for s in plan.scheduled:  # every token to compute has a slot in the block table
        assert len(s.seq.block_table) * sched.bm.block_size >= s.seq.num_computed_tokens + s.num_new_tokens
    sampled = {s.seq.request_id: (rng.randrange(0, 5), None) for s in plan.scheduled if s.samples}
    touched = sched.update(plan, sampled, accepted)
    for seq in sched.running:  # nothing held past the next step's need (a rejected draft's blocks)
        assert len(seq.block_table) <= sched.bm.blocks_needed(len(seq.token_ids)), seq.request_id
    return touched


request = st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.sampled_from("ab"))
op = st.one_of(
    st.tuples(st.just("add"), request),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=60),
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    seed=st.integers(0, 2**16),
    drafting=st.booleans(),
)
def test_random_operations_keep_integrity(ops, num_blocks, block_size, max_num_seqs, budget, seed, drafting):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    proposer = NgramProposer(4, 1, 3) if drafting else None  # drafts while at most 4 run, none waits
    sched = Scheduler(
        bm,
        max_num_seqs,
        budget,
        max_model_len=num_blocks * block_size,
        eos_token_ids=(EOS,),
        proposer=proposer,
        draft_max_batch=4 if drafting else 0,
    )
    ids: list[str] = []
    for kind, arg in ops:
        if kind == "add":
            prompt_len, max_tokens, priority, salt = arg
            prompt_len = min(prompt_len, sched.max_model_len - 1)
            rid = f"r{len(ids)}"
            # A small alphabet makes shared prefixes (and so prefix-cache hits) common.
            prompt = [rng.randrange(1, 3) for _ in range(prompt_len)]
            sched.add(Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), priority, salt))
            ids.append(rid)
        elif kind == "step":
            for _ in range(arg):
                fake_step(sched, rng)
                sched.check_integrity()
        elif ids:
            seq = sched.abort(ids[arg % len(ids)])
            assert seq is None or seq.finish_reason is FinishReason.ABORT
        sched.check_integrity()
    for _ in range(10_000):  # run everything to completion: it must terminate
        if not sched.has_unfinished():
            break
        fake_step(sched, rng)
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
    bm.check_integrity([])


def test_preemption_picks_lowest_priority_then_newest():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12)
    old_low = Sequence("old-low", [1] * 4, SamplingParams(max_tokens=8), priority=0, arrival_s=1.0)
    new_low = Sequence("new-low", [1] * 4, SamplingParams(max_tokens=8), priority=0, arrival_s=2.0)
    high = Sequence("high", [1] * 4, SamplingParams(max_tokens=8), priority=5, arrival_s=3.0)
    for seq in (old_low, new_low, high):
        sched.add(seq)
    rng = random.Random(0)
    fake_step(sched, rng)  # 3 one-block prompts; 1 block left
    plan = sched.schedule()  # each needs a second block: one must go
    assert [s.request_id for s in plan.preempted] == ["new-low"]
    assert sched.num_preemptions == 1
    sched.check_integrity()


def test_high_priority_waiting_request_preempts_lower_running():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=8)
    low = Sequence("low", [1] * 6, SamplingParams(max_tokens=4), priority=0)
    sched.add(low)
    plan = sched.schedule()
    assert [s.seq.request_id for s in plan.scheduled] == ["low"]
    sched.update(plan, {"low": (5, None)})  # low now holds both blocks
    urgent = Sequence("urgent", [2] * 6, SamplingParams(max_tokens=1), priority=9)
    sched.add(urgent)
    plan = sched.schedule()
    assert [s.request_id for s in plan.preempted] == ["low"]
    assert [s.seq.request_id for s in plan.scheduled] == ["urgent"]
    sched.check_integrity()


def test_prefix_blocks_are_shared_and_salted():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    rng = random.Random(0)
    sched.add(Sequence("a", prompt, SamplingParams(max_tokens=2), salt="t1"))
    fake_step(sched, rng)
    sched.add(Sequence("b", prompt, SamplingParams(max_tokens=2), salt="t1"))
    sched.add(Sequence("c", prompt, SamplingParams(max_tokens=2), salt="t2"))
    plan = sched.schedule()
    new = {s.seq.request_id: s.num_new_tokens for s in plan.scheduled}
    assert new["b"] == 1  # 12 of 13 tokens from the cache
    assert new["c"] == 13  # another tenant: nothing shared
    a, b = sched.requests["a"], sched.requests["b"]
    assert a.block_table[:3] == b.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    sched.check_integrity()


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_token_bytes_are_each_ids_four_little_endian_bytes(token_ids):
    assert token_bytes(token_ids) == b"".join(t.to_bytes(4, "little") for t in token_ids)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_bytes_refuse_what_four_unsigned_bytes_cannot_hold(bad):
    with pytest.raises(OverflowError):
        token_bytes([1, bad])
