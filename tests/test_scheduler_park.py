"""Backpressure as a scheduler operation (worker/scheduler.py `park` / `unpark`, pure Python, no
model): a parked sequence gets no compute, keeps its KV blocks and its slot (no waiting sequence
is admitted in its place), may be aborted while parked, and is back in its queue after `unpark`;
random add / park / step / abort / unpark sequences keep `check_integrity()` true after every
operation and free every block at the end."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_scheduler_props import fake_step
from worker.block_manager import BlockManager
from worker.scheduler import Scheduler
from worker.sequence import Sequence, SequenceStatus
from worker.types import FinishReason, SamplingParams


def scheduler(num_blocks: int = 16, max_num_seqs: int = 2) -> Scheduler:
    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    # A sequence fits the pool alone (as LLMEngine sizes max_model_len).
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=num_blocks * 4)


def add(sched: Scheduler, rid: str, prompt_len: int = 5, max_tokens: int = 6) -> Sequence:
    seq = Sequence(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add(seq)
    return seq


def test_a_parked_sequence_keeps_its_blocks_and_its_slot_and_gets_no_compute():
    sched = scheduler(max_num_seqs=2)
    a = add(sched, "a")
    add(sched, "b")
    rng = random.Random(0)
    fake_step(sched, rng)  # both prefilled: both slots taken
    add(sched, "c")
    blocks = list(a.block_table)
    parked = sched.park({"a", "unknown"})
    assert parked.running == [a] and not parked.waiting and sched.parked.running == [a]
    sched.check_integrity()
    plan = sched.schedule()
    assert [s.seq.request_id for s in plan.scheduled] == ["b"]  # "c" does not get a's slot
    assert a.block_table == blocks and a.status is SequenceStatus.RUNNING
    sched.update(plan, {"b": (3, None)})
    sched.check_integrity()
    computed = a.num_computed_tokens
    sched.unpark()
    assert not sched.parked and a in sched.running
    plan = sched.schedule()
    assert {s.seq.request_id for s in plan.scheduled} == {"a", "b"}
    assert a.num_computed_tokens == computed and a.block_table == blocks


def test_a_parked_waiting_sequence_goes_back_in_its_order():
    sched = scheduler(max_num_seqs=1)
    add(sched, "a")
    b, c = add(sched, "b"), add(sched, "c")
    fake_step(sched, random.Random(0))  # "a" runs; "b" and "c" wait
    sched.park({"b"})
    assert sched.waiting == [c]
    sched.unpark()
    assert sched.waiting == [b, c]
    sched.check_integrity()


def test_an_aborted_parked_sequence_frees_its_blocks_and_slot_and_stays_out():
    sched = scheduler(max_num_seqs=1)
    a = add(sched, "a")
    fake_step(sched, random.Random(0))
    add(sched, "b")
    sched.park({"a"})
    assert sched.abort("a") is a
    assert a.finish_reason is FinishReason.ABORT and not a.block_table
    sched.check_integrity()
    plan = sched.schedule()  # the slot is free again while the others are parked
    assert [s.seq.request_id for s in plan.scheduled] == ["b"]
    sched.unpark()
    assert a not in sched.running and a not in sched.waiting


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 8)),
    st.tuples(st.just("park"), st.sets(st.integers(0, 12), max_size=4)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 12)),
    st.tuples(st.just("unpark"), st.just(0)),
)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=50), num_blocks=st.integers(4, 16), seed=st.integers(0, 99))
def test_random_parking_keeps_integrity(ops, num_blocks, seed):
    sched = scheduler(num_blocks=num_blocks, max_num_seqs=3)
    rng = random.Random(seed)
    n = 0
    for kind, x, *rest in ops:
        if kind == "add":
            add(sched, f"r{n}", prompt_len=min(x, sched.max_model_len - 1), max_tokens=rest[0])
            n += 1
        elif kind == "park":
            sched.park({f"r{i}" for i in x})
        elif kind == "step":
            for _ in range(x):
                fake_step(sched, rng)
        elif kind == "abort":
            sched.abort(f"r{x}")
        else:
            sched.unpark()
        sched.check_integrity()
    sched.unpark()
    for _ in range(500):
        if not sched.has_unfinished():
            break
        fake_step(sched, rng)
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert sched.bm.num_free_blocks == num_blocks
