"""One generation request as the scheduler sees it (pure Python, no torch).

`token_ids` holds prompt + output tokens; `num_computed_tokens` counts those whose K/V are in the
cache. There is no prefill or decode phase: each step computes some of the
`num_tokens - num_computed_tokens` outstanding tokens (a prompt chunk, or the one newest token).
`block_table` lists the physical KV blocks backing positions 0.., block_size tokens each.
With async scheduling (worker/engine.py) the last `num_placeholders` entries of `token_ids` are
`PLACEHOLDER`: tokens a step in flight is sampling, counted as outstanding by the scheduler so the
next step can be planned before they are known; they are replaced when that step commits.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker.types import FinishReason, RequestOutput, SamplingParams

PLACEHOLDER = -1  # a token a step in flight has not returned yet (never a vocabulary id)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # higher = more urgent
    salt: str = ""  # prefix-cache namespace (the tenant)
    arrival_s: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, chained
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    num_emitted_tokens: int = 0  # output tokens already handed to the caller
    num_placeholders: int = 0  # trailing PLACEHOLDER tokens (async scheduling; 0 otherwise)
    matcher: object | None = None  # structured output: its llguidance matcher (worker/grammar.py)
    grammar_failed: bool = False  # its matcher failed mid-way (worker/grammar.py): ends LENGTH, not STOP
    # while its matcher is at its start: the grammar's shared compiled state, whose opening mask
    # (computed once per grammar) it takes (worker/grammar.py `Compiled`)
    opening: object | None = None
    draftable: bool = False  # speculative decoding may draft for it (set by `Scheduler.add`)
    draft_len: int = 0  # its next draft's length at most (adapted to what its drafts kept)
    # sampling.prompt_logprobs set: entry i = log P(prompt[i + 1] | prompt[..i]), filled as the
    # steps computing the prompt commit (LLMEngine); a recomputation after preemption adds nothing
    prompt_logprobs: list[float] = field(default_factory=list)
    # sampling.pooling set: the pooled prompt (worker/pooling.py), once its last chunk commits;
    # "mean" sums its chunks' rows into `pool_sum` (a float32 tensor) up to position `pool_upto`
    embedding: list[float] | None = None
    pool_sum: object | None = None
    pool_upto: int = 0
    # Prompt logprobs or pooling asked for: its steps read prompt rows (one attribute the model
    # runner checks per share per step, instead of the sampling fields)
    reads_prompt: bool = field(init=False)
    # Stop conditions, precomputed (host time per sequence per step): the token ids that end it
    # and the length at which it ends (`Scheduler.add` adds the EOS ids and max_model_len).
    stop_ids: frozenset[int] = field(init=False)
    max_num_tokens: int = field(init=False)
    # Scheduling order, a key compared by `Scheduler.schedule`'s sort of the running list every
    # step: higher priority first, then older first (priority and arrival never change).
    order: tuple[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stop_ids = frozenset(self.sampling.stop_token_ids)
        self.max_num_tokens = len(self.prompt_token_ids) + self.sampling.max_tokens
        self.order = (-self.priority, self.arrival_s)
        self.reads_prompt = self.sampling.prompt_logprobs is not None or bool(self.sampling.pooling)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose value is known: all of them but the trailing placeholders."""
        return len(self.token_ids) - self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for the prompt's logprobs and not all of them are in yet: its prompt must be
        computed (no prefix-cache hit)."""
        return (
            self.sampling.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def needs_whole_prompt(self) -> bool:
        """Its prompt rows must all be computed (no prefix-cache hit): prompt logprobs still to
        come, or mean pooling."""
        return self.needs_prompt_logprobs or self.sampling.pooling == "mean"

    def add_pooled(self, first: int, rows: int, total) -> None:
        """A "mean" chunk's row sum (positions first .. first + rows - 1), in commit order. A chunk
        at position 0 starts the sum again (a recomputation after preemption computes the whole
        prompt again); the one that completes the prompt sets `embedding`."""
        if first == 0:
            self.pool_sum, self.pool_upto = total.clone(), rows
        elif first == self.pool_upto:
            self.pool_sum += total
            self.pool_upto += rows
        else:
            return  # a chunk of a pass a recomputation has replaced
        if self.pool_upto == len(self.prompt_token_ids):
            self.embedding = (self.pool_sum / self.pool_upto).tolist()

    def add_prompt_logprobs(self, first: int, values: list[float]) -> None:
        """Entries `first`, `first + 1`, ... of `prompt_logprobs` (a step's chunk); those already
        held (a recomputation) are skipped."""
        have = len(self.prompt_logprobs)
        if first <= have:
            self.prompt_logprobs.extend(values[have - first :])

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: higher priority first, then older first."""
        return self.order


def next_output(seq: Sequence) -> RequestOutput:
    """What `seq` has not delivered yet, as the engine hands it out after a step."""
    # Slices of the tail only: no copy of the whole output per step. Attributes read once and
    # no properties: this runs for every sequence every step (`make bench-host`).
    token_ids, num_prompt = seq.token_ids, len(seq.prompt_token_ids)
    start = num_prompt + seq.num_emitted_tokens
    known = len(token_ids) - seq.num_placeholders  # placeholders are not output
    new_lp = seq.logprobs[start - num_prompt :] if seq.sampling.logprobs else None
    seq.num_emitted_tokens = emitted = known - num_prompt
    arrival, first_scheduled, first_token = seq.arrival_s, seq.first_scheduled_s, seq.first_token_s
    prompt_lp = None  # with the first tokens only
    if start == num_prompt and known > start and seq.sampling.prompt_logprobs is not None:
        prompt_lp = seq.prompt_logprobs
    return RequestOutput(
        seq.request_id,
        token_ids[start:known],
        new_lp,
        seq.status is SequenceStatus.FINISHED,
        seq.finish_reason,
        num_prompt,
        emitted,
        seq.num_cached_tokens,
        first_scheduled - arrival if first_scheduled else 0.0,
        first_token - arrival if first_token else 0.0,
        seq.num_preemptions,
        prompt_lp,
        seq.embedding if start == num_prompt and known > start else None,
    )
