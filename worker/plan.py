"""A step's plan: which sequences a step computes and how many tokens each (pure Python).

`SchedulerOutput` is what `Scheduler.schedule()` returns (worker/scheduler.py) and what the model
runner builds a step from (worker/model_runner.py, worker/input_batch.py): `scheduled`, one
`ScheduledSeq` per sequence in the step (in the scheduler's order), and `preempted`, the
sequences the plan sent back to waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.sequence import Sequence


@dataclass(slots=True, init=False)
class ScheduledSeq:
    """One sequence's share of a step. The sequence's state at planning time is copied here (its
    start position, block table and length), so a plan in flight stays what it was while the
    engine thread plans the next step (async scheduling). Built per sequence per step: slots and
    a plain __init__ (host time per sequence, `make bench-host`)."""

    seq: Sequence
    num_new_tokens: int
    start: int  # seq.num_computed_tokens when planned
    block_table: list[int]  # the list itself: it only grows by append
    num_blocks: int  # its length when planned
    samples: bool  # computes the last outstanding token, so it samples
    # Speculative decoding (worker/speculative.py): tokens computed after the newest one, each
    # sampled after; `num_new_tokens` counts them (1 + len(draft)). Empty for every other share.
    draft: tuple[int, ...]

    def __init__(self, seq: Sequence, num_new_tokens: int, draft: tuple[int, ...] = ()) -> None:
        self.seq, self.num_new_tokens, self.draft = seq, num_new_tokens, draft
        self.start = start = seq.num_computed_tokens
        self.block_table = table = seq.block_table
        self.num_blocks = len(table)
        self.samples = start + num_new_tokens - len(draft) == len(seq.token_ids)

    @property
    def preempted(self) -> bool:
        """The sequence lost this plan's blocks since (preempted: `BlockManager.free` replaces the
        list; async scheduling, a later plan preempted it while this one was in flight)."""
        return self.seq.block_table is not self.block_table


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    drafted: int = 0  # scheduled sequences with a draft (speculative decoding)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
