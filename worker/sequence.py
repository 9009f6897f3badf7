"""One generation request as the scheduler sees it (pure Python, no torch).

`token_ids` holds prompt + output tokens; `num_computed_tokens` counts those whose K/V are in the
cache. There is no prefill or decode phase: each step computes some of the
`num_tokens - num_computed_tokens` outstanding tokens (a prompt chunk, or the one newest token).
`block_table` lists the physical KV blocks backing positions 0.., block_size tokens each.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker.types import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
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

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: higher priority first, then older first."""
        return (-self.priority, self.arrival_s)
