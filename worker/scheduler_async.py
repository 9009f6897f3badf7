"""Async scheduling's half of the scheduler (worker/scheduler.py), inherited by `Scheduler`.

Async scheduling (worker/engine.py): `advance(plan)` applies a launched plan before its tokens
are known (computed counts move on; each sampling sequence gets a PLACEHOLDER token), so
`schedule(speculative=True)` plans the next step while it runs (its sequences are `pinned`).
That plan leaves out sequences whose pending token is certainly their last (max_tokens,
max_model_len) and, when the pool is short, frees their blocks first (`_retire`: they wait,
uncounted, for that token); then it preempts as the synchronous plan does (lowest priority,
newest), the step in flight's sequences included: their blocks go back at once (the step in
flight writes its KV into them before the next step, queued behind it, reuses them). A sequence
preempted with its token pending waits with its PLACEHOLDER and is not admitted before the
token is known. `commit(plan, sampled)` fills the placeholders in and checks stop conditions,
for preempted (waiting) sequences too: such a token is output, and may finish its sequence
there; blocks are hashed only for sequences still holding the plan's block table
(`ScheduledSeq.preempted`). A sequence that ends (stop, abort) while a plan in flight holds it
(`pinned`) frees its blocks at once, as a victim does: nothing reads them after its end, the
writes still pending (that plan's: a decode whose token is dropped, or an aborted prompt chunk)
come before any later plan's, and that plan's commit skips it, so no block it alone completes
gets a hash; the full blocks hashed before stay valid (committed KV; reallocation drops a hash).
`rollback(plan)` undoes `advance` (a finished sequence is skipped: its output is final).
Proven by tests/test_async_scheduling.py, tests/test_async_preemption.py and
tests/test_async_ends_in_flight.py.
"""

from __future__ import annotations

import time

from worker.plan import SchedulerOutput
from worker.sequence import PLACEHOLDER, Sequence, SequenceStatus


class AsyncPlans:
    """Needs the scheduler's `bm`, `running`, `waiting`, `num_generation_tokens`, `_preempt`,
    `_finish`, `_stop_reason` and `_ends_by_length`."""

    def advance(self, out: SchedulerOutput) -> None:
        """A plan was launched: count its tokens as computed and give every sampling sequence a
        placeholder for the token it will sample, before the step returns."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_placeholders += 1

    def commit(self, out: SchedulerOutput, sampled: dict[str, tuple[int, float | None]]) -> list[Sequence]:
        """`update` for a plan that went through `advance`: hash the blocks it filled, put the
        sampled tokens in the placeholders, finish what is done. A sequence that ended while the
        plan ran (aborted, or stopped by the step before) has its token dropped and nothing hashed
        (its blocks went back when it ended and may hold another sequence's KV). One preempted
        while the plan ran (waiting, its blocks gone) gets its token (output, as the synchronous
        engine would have before preempting it) and may finish by it; nothing is hashed for it.
        Returns the sequences that produced a token."""
        now = time.monotonic()
        touched = []
        bs = self.bm.block_size
        finished = SequenceStatus.FINISHED
        # `is_finished`, `ScheduledSeq.preempted` and `_stop_reason`'s test inline: hot loop.
        for s in out.scheduled:
            seq = s.seq
            if seq.status is finished:
                continue
            done = s.start + s.num_new_tokens
            preempted = seq.block_table is not s.block_table
            if not preempted and done // bs > len(seq.block_hashes):
                self.bm.commit(seq, done)
            if not s.samples:
                continue
            token, logprob = sampled[seq.request_id]
            seq.token_ids[done] = token
            seq.num_placeholders -= 1
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.first_token_s is None:
                seq.first_token_s = now
            if token in seq.stop_ids or done + 1 >= seq.max_num_tokens:
                reason = self._stop_reason(seq, token, done + 1)
                # Preempted: in `waiting`. A parked one (backpressure) stays in `parked`, finished,
                # until `unpark` drops it.
                queue = self.waiting if preempted else self.running
                if seq in queue:
                    queue.remove(seq)
                self._finish(seq, reason)
            touched.append(seq)
        self.num_generation_tokens += len(touched)
        return touched

    def rollback(self, out: SchedulerOutput) -> None:
        """Undo `advance` for a launched plan whose step failed (plans undone newest first). A
        sequence preempted since keeps its computed count (0, or what a later plan, undone before,
        left): it recomputes; only its placeholder goes."""
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:
                continue
            if not s.preempted:
                seq.num_computed_tokens = s.start
            if s.samples:
                seq.token_ids.pop()
                seq.num_placeholders -= 1

    def _pending_last(self, seq: Sequence) -> bool:
        """Its pending token (a placeholder) is certainly its last: max_tokens or max_model_len."""
        return bool(seq.num_placeholders) and self._ends_by_length(seq, seq.num_tokens)

    def _retire(self) -> bool:
        """Speculative plan, pool short: free the blocks of the running sequences whose pending
        token is their last (the synchronous engine would have finished them before this plan).
        They wait for that token, not counted as preempted; it finishes them when the step in
        flight commits. False if there were none."""
        done = [seq for seq in self.running if self._pending_last(seq)]
        for seq in done:
            self._preempt(seq, count=False)
        return bool(done)
