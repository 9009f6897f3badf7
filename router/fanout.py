"""The choices of one request (OpenAI `n`): prepared once, generated each on its own.

Contract
- `Fanout`: shared by the choices of one prompt; `once(prepare)` runs `prepare()` (validation,
  grammar compile, tokenizing: router/service.py `_prepare`) once, as a task of its own, and hands
  its result (or its error) to every choice that asks.
- `ChoiceOf(fanout, request_id, seed_offset)`: one choice; `applied(req, limits)` -> the prepared
  request with the choice's own (checked) request id and seed + j (mod 2**64).
- state: the preparation task. Proven by: tests/test_openai_requests.py (ids and seeds),
  tests/test_request_path.py (n choices tokenized once).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from router.config import Limits
from router.validation import ValidRequest, checked_request_id


class Fanout:
    """The choices of one request (OpenAI `n`, router/openai/app.py): validated, compiled and
    tokenized once, by whichever choice gets there first; each is then admitted, queued and
    generated on its own. The preparation runs as a task of its own, so a choice that is
    cancelled while it prepares does not fail the others; its result (or error) is every
    choice's."""

    def __init__(self) -> None:
        self._task: asyncio.Future | None = None

    async def once(self, prepare: Callable[[], Awaitable]):
        if self._task is None:
            self._task = asyncio.ensure_future(prepare())
            self._task.add_done_callback(_retrieved)  # every choice may be gone when it fails
        return await asyncio.shield(self._task)


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


@dataclasses.dataclass(frozen=True)
class ChoiceOf:
    """One choice of a `Fanout`: its own request id, and `seed_offset` j (a seeded request's j-th
    choice samples with seed + j, mod 2**64: distinct, reproducible samples)."""

    fanout: Fanout
    request_id: str
    seed_offset: int = 0

    def applied(self, req: ValidRequest, limits: Limits) -> ValidRequest:
        seed = req.seed
        if seed is not None and self.seed_offset:
            seed = (seed + self.seed_offset) % 2**64
        return dataclasses.replace(req, request_id=checked_request_id(self.request_id, limits), seed=seed)
