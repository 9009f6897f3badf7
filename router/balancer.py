"""Worker choice: least outstanding tokens.

Contract
- input: candidate workers (anything with `address`, `outstanding_tokens`, `num_inflight`), the
  addresses to exclude (already tried for this request).
- output: the candidate with the fewest outstanding tokens (ties: fewest in-flight requests, then
  rotating), or None. A `Lease` charges a request's tokens to its worker while it runs:
  prompt + max_tokens at dispatch, minus each generated token, released when the stream ends.
- state: the rotation counter; the counters live on the worker handles and are only touched
  through `Lease` (single event loop, no locks).
- failure modes: none.
- proven by: tests/test_router_balancer.py, tests/test_grpc_two_workers.py (spread).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Protocol, TypeVar


class Loaded(Protocol):
    address: str
    outstanding_tokens: int
    num_inflight: int


W = TypeVar("W", bound=Loaded)


class LeastOutstandingTokens:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[W], exclude: Collection[str] = ()) -> W | None:
        pool = [w for w in candidates if w.address not in exclude]
        if not pool:
            return None
        best = min((w.outstanding_tokens, w.num_inflight) for w in pool)
        tied = [w for w in pool if (w.outstanding_tokens, w.num_inflight) == best]
        return tied[next(self._turn) % len(tied)]


class Lease:
    """Charges one request's expected work to a worker until `release`."""

    def __init__(self, worker: Loaded, num_prompt_tokens: int, max_tokens: int):
        self._worker = worker
        self._charged = num_prompt_tokens + max_tokens
        self._prompt = num_prompt_tokens
        self._released = False
        worker.outstanding_tokens += self._charged
        worker.num_inflight += 1

    def progress(self, num_new_tokens: int, first: bool) -> None:
        """`num_new_tokens` generated; on the first one the prompt's prefill is done too."""
        done = num_new_tokens + (self._prompt if first else 0)
        done = min(done, self._charged)
        self._charged -= done
        self._worker.outstanding_tokens -= done

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._worker.outstanding_tokens -= self._charged
        self._worker.num_inflight -= 1
        self._charged = 0
