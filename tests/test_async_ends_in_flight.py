"""Sequences that end while a step in flight holds them (async scheduling: worker/scheduler.py
`_finish`, worker/engine.py), over tests/test_async_preemption.py's `FakeRunner` (each step's
inputs and a simulated KV cache checked in step order, so a block reused while its owner still
needed it, or a prefix-cache hit on a block nobody wrote, fails there).

A sequence that ends (EOS or a stop id at the commit of the step before, or an abort) while the
plan in flight holds it gives its blocks back at once: that step's KV write into them comes before
any later step's, queued behind it. Each case is made to happen and asserted to have happened: the
next plan, made while that step runs, admits a sequence into the freed block (with the blocks
held until the step returned, as before, the pool is one block short and these tests fail); and a
failing step rolled back after such a reuse, with a prompt that would hit the freed block had the
failed step's block been hashed.
"""

from __future__ import annotations

import pytest

from tests.test_async_preemption import EOS, Driver, make_engine, next_token
from worker.types import FinishReason, SamplingParams


def b_ends_in_flight(sp_b: SamplingParams, fail_at: tuple[int, ...] = ()) -> tuple[Driver, int]:
    """a (2-token prompt) and b (3; its tokens are EOS), a block each of 3. Step 1 runs the prompts
    and launches the plan that decodes both in place (the 2nd launch): it is in flight, holding b,
    when b ends (EOS at step 1's commit, or an abort after it). Returns the driver and b's block."""
    d = Driver(make_engine(3, token_fn=lambda rid, p: EOS if rid == "b" else next_token(rid, p)))
    d.engine.runner.fail_at = set(fail_at)
    d.add("a", [1, 2], SamplingParams(max_tokens=6, ignore_eos=True))
    d.add("b", [5, 6, 7], sp_b)
    d.step()
    [block] = d.engine.plans[0][2].scheduled[1].block_table
    return d, block


def b_is_free_and_c_arrives(d: Driver) -> None:
    """b has ended, the step in flight still holds it: its block is free already, so the next plan
    admits c (2 blocks: the pool's last two, b's among them), which writes it after that step."""
    b = d.engine.plans[0][2].scheduled[1].seq
    assert b.is_finished and b in d.engine.scheduler.pinned and d.engine.has_in_flight
    assert d.engine.block_manager.num_free_blocks == 2 and not b.block_table
    d.add("c", [5, 6, 7, EOS, 9], SamplingParams(max_tokens=4, ignore_eos=True))


def c_holds(d: Driver) -> list[int]:
    """c's block table in the third plan (made while the second step was in flight)."""
    speculative, victims, plan = d.engine.plans[2]
    assert speculative and not victims
    return next(s.block_table for s in plan.scheduled if s.seq.request_id == "c")


def test_sequence_ending_by_eos_in_flight_gives_its_block_to_the_next_plan():
    d, block = b_ends_in_flight(SamplingParams(max_tokens=6))
    assert d.finished == {"b": FinishReason.STOP} and d.tokens["b"] == [EOS]
    b_is_free_and_c_arrives(d)
    d.step()
    assert block in c_holds(d)
    d.drain()
    assert d.engine.num_sync_steps == 1


def test_abort_in_flight_gives_its_block_to_the_next_plan():
    d, block = b_ends_in_flight(SamplingParams(max_tokens=6, ignore_eos=True))
    assert d.engine.abort("b")
    b_is_free_and_c_arrives(d)
    outs = d.step()
    assert outs["b"].finish_reason is FinishReason.ABORT and outs["b"].new_token_ids == []
    assert block in c_holds(d)
    d.drain()


def test_failing_step_after_the_block_was_reused_rolls_back():
    """The step still writing b's block fails; so does c's (queued behind it, fed a's token from
    it): both are undone, c keeps b's block with nothing computed and recomputes. b's block got no
    hash from the failed step, so c's prompt (b's + EOS) does not hit it (the KV check would fail)."""
    d, block = b_ends_in_flight(SamplingParams(max_tokens=6), fail_at=(1,))
    assert d.finished == {"b": FinishReason.STOP}
    b_is_free_and_c_arrives(d)
    with pytest.raises(RuntimeError, match="injected"):
        d.step()
    c = d.engine.scheduler.requests["c"]
    assert c_holds(d) is c.block_table and block in c.block_table and c.num_computed_tokens == 0
    assert not c.num_placeholders and c in d.engine.scheduler.running
    d.engine.scheduler.check_integrity()
    d.drain()
