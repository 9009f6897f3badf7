"""A rejected draft's new KV block goes back to the pool after its step (BlockManager.trim): it
stayed with its sequence, and the next step preempted another sequence for lack of it
(docs/speculative.md: "A draft never preempts"). Found by review, 2026-12-04."""

from __future__ import annotations

from worker.block_manager import BlockManager
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.speculative import NgramProposer
from worker.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _run(proposer):
    """A (older, repetitive) and B decode in a 5-block pool (block size 4), one block free. A's
    draft crosses into a new block, B's next decode (one step later) needs that block. The model
    rejects A's whole draft."""
    bm = BlockManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, 4, 64, 128, proposer=proposer, draft_max_batch=4)
    a = Sequence("a", [5, 6, 7, 5, 6], GREEDY)  # 2 blocks, newest token at position 5
    b = Sequence("b", [1, 2, 3, 4, 9, 10, 11], GREEDY)  # 2 blocks, position 8 needs a third
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.update(plan, {"a": (7, None), "b": (12, None)})
    plan = sched.schedule()
    drafted = [s for s in plan.scheduled if s.draft]
    sched.update(plan, {"a": (99, None), "b": (13, None)}, {s.seq.request_id: [] for s in drafted})
    plan = sched.schedule()  # A: position 6 (its own blocks); B: position 8 (a new block)
    sched.check_integrity()
    return sched, bm, a, drafted, plan


def test_rejected_draft_block_does_not_preempt_the_next_step():
    _, _, _, drafted, plain = _run(None)
    assert not drafted and not plain.preempted
    _, bm, a, drafted, plan = _run(NgramProposer(4, 1, 3))
    assert drafted, "the setup must draft"
    assert len(a.block_table) == bm.blocks_needed(len(a.token_ids))  # nothing held for a rejected draft
    # A computed 6 tokens and will need its third block only at position 8, yet it still holds it
    held_for_nothing = len(a.block_table) - bm.blocks_needed(len(a.token_ids))
    assert not plan.preempted, (
        f"preempted {[s.request_id for s in plan.preempted]} while A holds {held_for_nothing} block(s) "
        "written only by its rejected draft"
    )
