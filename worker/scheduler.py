"""Continuous-batching scheduler (pure Python, no torch).

Contract:
- Input: sequences (`add`), aborts (`abort`), and after each model step the sampled tokens
  (`update`).
- Output: `schedule()` returns a `SchedulerOutput` plan (worker/plan.py): for each scheduled
  sequence how many of its outstanding tokens to compute this step. One token budget per step
  (`max_num_batched_tokens`) is shared by decodes (1 token) and prompt chunks (chunked prefill),
  so prefill and decode mix freely; at most `max_num_seqs` run at once.
- State: `waiting` (sorted by priority, then arrival) and `running` queues; the block manager.
- Speculative decoding (worker/speculative.py, whose `Drafting` half this class inherits):
  while at most `draft_max_batch` sequences run and none waits, a decoding sequence with a draft
  is planned for `1 + len(draft)` tokens (its `ScheduledSeq.draft`; new blocks only where the
  free ones left cover the running sequences after it, else the draft is cut to the blocks it
  holds: a draft never preempts); `update` takes the drafts the model kept (`accepted`), then
  the sampled token, up to the first that ends the sequence, and sets its computed tokens to
  those whose KV holds known tokens (what rejected drafts wrote lies beyond and is overwritten).
  Its next draft length adapts (`draft_len`).
- Backpressure (worker/async_engine.py): `park(request_ids)` moves sequences from the queues to
  `parked` (their readers are behind): no plan schedules them, they keep their KV blocks, and a
  running one keeps its slot (`max_num_seqs` counts it, so no waiting sequence takes it); an abort
  ends a parked one as any other; `unpark()` puts back every parked sequence not finished
  meanwhile (async scheduling: the step in flight may finish one).
- Fails how: when KV blocks run out, the lowest-priority, newest running sequence is preempted by
  recompute (blocks freed, it returns to the front of its priority class in `waiting`). A waiting
  sequence of higher priority may preempt a lower-priority running one.
- Async scheduling: worker/scheduler_async.py (`advance`, `commit`, `rollback`, the mixin this
  class inherits).
- Proven by: tests/test_scheduler_props.py (hypothesis: integrity after every step, all blocks free
  at the end), tests/test_engine_batching.py (batched == alone, token for token) and
  tests/test_async_scheduling.py (async == sync), tests/test_async_preemption.py (preemption while
  a step is in flight: targeted cases and hypothesis workloads over a runner that checks each
  step's inputs and KV cache), tests/test_async_ends_in_flight.py (sequences ending in flight: their
  blocks reused by the next plan, a failing step rolled back after that); park/unpark by
  tests/test_scheduler_park.py (targeted cases and hypothesis workloads), tests/test_async_handoff.py
  and tests/test_async_engine_loop.py.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from operator import attrgetter

from worker.block_manager import BlockManager
from worker.plan import ScheduledSeq, SchedulerOutput
from worker.scheduler_async import AsyncPlans
from worker.sequence import Sequence, SequenceStatus
from worker.speculative import Drafting, NgramProposer, draftable
from worker.types import FinishReason

_ORDER = attrgetter("order")


@dataclass
class Parked:
    """The sequences `Scheduler.park` took out of its queues, for `unpark` to put back."""

    running: list[Sequence] = field(default_factory=list)
    waiting: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)


class Scheduler(Drafting, AsyncPlans):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        proposer: NgramProposer | None = None,
        draft_max_batch: int = 0,
    ):
        self.bm = block_manager
        # Speculative decoding: drafts for decoding sequences while at most `draft_max_batch` run
        # and none waits.
        self.proposer, self.draft_max_batch = proposer, draft_max_batch
        self.num_draft_tokens = 0  # cumulative: tokens drafted and verified
        self.num_accepted_tokens = 0  # cumulative: drafted tokens kept
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # cumulative, counted when a request is first scheduled
        self.num_generation_tokens = 0  # cumulative sampled tokens
        # Plans launched and not yet committed, oldest first (async scheduling; the engine keeps
        # it): their sequences are `pinned`.
        self.in_flight: deque[SchedulerOutput] = deque()
        self.parked = Parked()  # out of the queues for backpressure (`park`); slots kept

    # -- intake ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check(seq)
        if not seq.sampling.ignore_eos:
            seq.stop_ids = seq.stop_ids | self.eos_token_ids
        seq.max_num_tokens = min(seq.max_num_tokens, self.max_model_len)
        seq.draftable = self.proposer is not None and draftable(seq.sampling)
        seq.draft_len = self.proposer.num_tokens if self.proposer is not None else 0
        self.requests[seq.request_id] = seq
        self._enqueue(seq)

    def check(self, seq: Sequence) -> None:
        """ValueError naming why `add` would refuse `seq` (duplicate id, empty or too long prompt)."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request_id {seq.request_id!r}")
        if not seq.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_prompt_tokens} tokens; the limit is "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len})"
            )

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        for queue in (self.running, self.waiting, self.parked.running, self.parked.waiting):
            if seq in queue:
                queue.remove(seq)
                break
        self._finish(seq, FinishReason.ABORT)
        return seq

    # -- backpressure ---------------------------------------------------------------------
    def park(self, request_ids: Collection[str]) -> Parked:
        """Takes the queued sequences of `request_ids` out of the queues until `unpark`: no plan
        schedules them (their readers are behind). They keep their KV blocks; a running one keeps
        its slot (no waiting sequence is admitted in its place). Returns the ones it took."""
        taken = Parked(
            [seq for seq in self.running if seq.request_id in request_ids],
            [seq for seq in self.waiting if seq.request_id in request_ids],
        )
        for seq in taken.running:
            self.running.remove(seq)
        for seq in taken.waiting:
            self.waiting.remove(seq)
        self.parked.running += taken.running
        self.parked.waiting += taken.waiting
        return taken

    def unpark(self) -> None:
        """Puts every parked sequence back in its queue (a running one's slot back to the pool),
        except those finished meanwhile by the step in flight (async scheduling)."""
        parked, self.parked = self.parked, Parked()
        self.running.extend(seq for seq in parked.running if not seq.is_finished)
        for seq in parked.waiting:
            if not seq.is_finished:
                bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    @property
    def pinned(self) -> set[Sequence]:
        """The sequences of the plans in flight (built on demand: integrity checks and tests)."""
        return {s.seq for plan in self.in_flight for s in plan.scheduled}

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- planning -------------------------------------------------------------------------
    def schedule(self, speculative: bool = False) -> SchedulerOutput:
        """The next step's plan. `speculative`: a step is in flight (async scheduling): leave out
        the sequences whose pending token ends them, and free them first when the pool is short."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        running.sort(key=_ORDER)  # Sequence.sort_key, without a call per sequence
        room = self.bm.block_size  # tokens a block holds: most decodes need no new block
        # Drafts while the step stays small: no sequence waits to join, at most draft_max_batch run.
        drafting = (
            self.proposer is not None
            and not speculative
            and not self.waiting
            and 0 < len(running) <= self.draft_max_batch
        )
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if speculative and seq.num_placeholders and len(seq.token_ids) >= seq.max_num_tokens:
                # `_pending_last`, inline (every running sequence, every speculative plan)
                i += 1  # its placeholder is its last token, whatever it turns out to be
                continue
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > budget:
                n = budget
            if (
                drafting
                and n == 1
                and seq.draftable
                and self._schedule_draft(out, seq, budget - (len(running) - i))
            ):
                budget -= out.scheduled[-1].num_new_tokens
                i += 1
                continue
            if computed + n <= len(seq.block_table) * room:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            while not self.bm.allocate(seq, n):
                if speculative and self._retire():
                    i = running.index(seq)  # retired sequences before it moved it
                    continue
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget, speculative)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, speculative: bool = False) -> int:
        waiting, j = self.waiting, 0
        slots = self.max_num_seqs - len(self.parked.running)  # a parked sequence keeps its slot
        while j < len(waiting) and budget > 0 and len(self.running) < slots:
            seq = waiting[j]
            if seq.num_placeholders:  # preempted while the step in flight samples its token
                if self._ends_by_length(seq, seq.num_tokens):
                    j += 1  # retired: that token ends it; those behind it go on
                    continue
                break  # admitted once its token is known (next plan): none behind it before
            if not seq.block_table and not seq.needs_whole_prompt:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                if speculative and self._retire():
                    j = waiting.index(seq)  # a retired sequence may sort before it
                    continue
                victim = self.running[-1] if self.running else None
                if victim is None or victim.priority >= seq.priority:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                for k, s in enumerate(out.scheduled):
                    if s.seq is victim:
                        budget += out.scheduled.pop(k).num_new_tokens
                        break
            else:
                waiting.pop(j)
                if seq.first_scheduled_s is None:  # first admission: queue time ends here
                    seq.first_scheduled_s = time.monotonic()
                    seq.num_cached_tokens = seq.num_computed_tokens
                    self.num_prompt_tokens += seq.num_prompt_tokens
                    if not seq.sampling.whole_prompt:  # a scored or mean-pooled prompt never looks it up
                        self.bm.num_prefix_queries += seq.num_prompt_tokens
                        self.bm.num_prefix_hits += seq.num_cached_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                continue
            self.bm.free(seq)  # hit blocks go back (hashes kept) until later
            break
        return budget

    # -- results --------------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, tuple[int, float | None]],
        accepted: dict[str, list[tuple[int, float | None]]] | None = None,
    ) -> list[Sequence]:
        """Advance computed tokens, append sampled ones, finish what is done. Returns the sequences
        that produced a token or finished this step. `accepted`: the draft tokens (and logprobs)
        each drafted sequence keeps, before its sampled token."""
        now = time.monotonic()
        touched = []
        bs, commit = self.bm.block_size, self.bm.commit
        for s in out.scheduled:
            seq = s.seq
            if s.draft:
                self._take_drafted(seq, len(s.draft), accepted[seq.request_id], sampled[seq.request_id], now)
                touched.append(seq)
                continue
            computed = seq.num_computed_tokens + s.num_new_tokens
            seq.num_computed_tokens = computed
            if computed // bs > len(seq.block_hashes):  # a block became full: hash it
                commit(seq)
            if computed != len(seq.token_ids):  # a prompt chunk that does not sample
                continue
            token, logprob = sampled[seq.request_id]
            seq.token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.first_token_s is None:
                seq.first_token_s = now
            # `_stop_reason`, inline (every sampling sequence, every step)
            if token in seq.stop_ids or len(seq.token_ids) >= seq.max_num_tokens:
                self.running.remove(seq)
                self._finish(seq, self._stop_reason(seq, token))
            touched.append(seq)
        self.num_generation_tokens += len(touched)
        return touched

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int | None = None) -> FinishReason | None:
        """Why `token`, the sequence's `num_tokens`-th (default: its last), ends it; None if not."""
        if token in seq.stop_ids:  # after a failed grammar, the EOS it forced cuts the output short
            return FinishReason.LENGTH if seq.grammar_failed else FinishReason.STOP
        if (len(seq.token_ids) if num_tokens is None else num_tokens) >= seq.max_num_tokens:
            return FinishReason.LENGTH
        return None

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """A sequence of `num_tokens` tokens has reached max_tokens or max_model_len."""
        return num_tokens >= seq.max_num_tokens

    # -- helpers --------------------------------------------------------------------------
    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        """Recompute preemption: blocks freed, back to `waiting`. With async scheduling `seq` may be
        in the step in flight (its PLACEHOLDER, if any, stays until that step commits)."""
        self.running.remove(seq)
        self.bm.free(seq)
        if count:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self._enqueue(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Blocks freed at once, also while a plan in flight holds it (async scheduling: that step
        writes its KV into them before any later step, queued behind it, reuses them; its commit
        skips a finished sequence, so they get no hash from it)."""
        self.bm.free(seq)
        if seq.num_placeholders:  # tokens it will never get
            del seq.token_ids[-seq.num_placeholders :]
            seq.num_placeholders = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def check_integrity(self) -> None:
        # A parked sequence the step in flight finished waits there, uncounted, for `unpark`.
        running = self.running + [s for s in self.parked.running if not s.is_finished]
        waiting = self.waiting + [s for s in self.parked.waiting if not s.is_finished]
        live = waiting + running
        assert len(live) == len(self.requests), "queues and request map disagree"
        assert len(self.running) + len(self.parked.running) <= self.max_num_seqs
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        assert all(s.status is SequenceStatus.WAITING for s in waiting)
        pinned = self.pinned
        for s in waiting:  # preempted while a plan in flight samples its token: no blocks
            assert not s.num_placeholders or (s in pinned and not s.block_table), (
                f"{s.request_id}: a placeholder outside a plan in flight"
            )
        self.bm.check_integrity(live)
