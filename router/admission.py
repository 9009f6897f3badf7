"""Admission control: refuse early, with a retry-after, or admit into the fair queue.

Contract
- input: `admit(tenant, num_prompt_tokens, max_tokens, priority=, deadline_s=, payload=)` for a
  validated, tokenized request; `deadline_s` on the controller's clock (time.monotonic).
- output: a `Ticket` whose `item` is now in the `FairQueue`, or `AdmissionError(reason,
  retry_after_ms, message)`. Checks, in order (tenant-attributable first):
    rate_limited       the tenant's requests/s or tokens/min bucket lacks 1 request or
                       prompt + max_tokens tokens; retry-after = exact refill time
    concurrency        the tenant already has max_concurrency open requests (queued + running)
    tenant_queue_full  the tenant already has max_queued requests waiting
    global_queue_full  the router already has max_queued_total requests waiting
    token_budget       prompt + max_tokens of all open requests would pass max_tokens_in_flight
    deadline           the estimated queue wait (FairQueue.estimated_wait_s) ends after deadline_s
  `claim(tenant, cost)` is what the router runs before tokenizing: the request-rate check (one
  request taken now and kept) and the caps below, after which the request counts as open until
  `admit(..., claim=)` takes it over or `Claim.release()`; so rate and concurrency are counted
  before any tokenizing (a huge-prompt flood is refused for microseconds each).
  `gate(tenant, cost)`: claim's checks, taking nothing (a front's, before it reads the body).
  `precheck(tenant, cost)` runs the three cap checks (concurrency, tenant_queue_full,
  global_queue_full) before the router spends time tokenizing, so a full router sheds in
  microseconds; `refuse(tenant, "no_capacity", ...)` counts a refusal decided by the caller (the
  router's --no-queue mode: no worker can start the request now).
  A refused request takes nothing (no rate tokens, no budget). Retry-after for the capacity
  reasons = the time the measured dispatch rate (or the tenant's weighted share of it) needs for
  the work that must leave first; `default_retry_after_ms` before any rate was measured; always
  within [1, max_retry_after_ms].
- state: per tenant two token buckets and the open-request count; the tokens in flight; counters
  `refusals[(tenant, reason)]` and `admitted[tenant]`. `Ticket.release()` (idempotent; call it
  when the stream ends however it ends) removes a still-queued item from the queue, returns the
  budget, and with `num_output_tokens` refunds unused max_tokens to the tokens/min bucket;
  `Ticket.refused()` (a refusal after admission, --no-queue) refunds the prompt's tokens too.
- failure modes: only AdmissionError (`router_error()`: DEADLINE_EXCEEDED for `deadline`,
  RESOURCE_EXHAUSTED for the rest); everything is synchronous (one event loop, no locks).
- proven by: tests/test_trust_admission.py (claims before tokenizing, the deadline status),
  tests/test_fairness_admission.py (each reason, retry-after values, isolation between
  tenants, ticket release); metric llm_admission_rejections_total{tenant,reason}.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router.errors import DeadlineExceeded, Overloaded, RouterError
from router.fair_queue import FairQueue, QueuedRequest
from router.rate_limit import TokenBucket

REASONS = (
    "rate_limited",
    "concurrency",
    "tenant_queue_full",
    "global_queue_full",
    "token_budget",
    "deadline",
    "no_capacity",
)


class AdmissionError(Exception):
    """A refusal: RESOURCE_EXHAUSTED with trailing metadata retry-after-ms, except a deadline
    that cannot be met, which is DEADLINE_EXCEEDED (`router_error()`)."""

    def __init__(self, reason: str, retry_after_ms: int, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.message = message

    def router_error(self) -> RouterError:
        if self.reason == "deadline":
            return DeadlineExceeded(self.message)
        return Overloaded(self.message, self.retry_after_ms)


class Claim:
    """A request's place in its tenant's request rate and concurrency, taken before the router
    spends time tokenizing it (`AdmissionController.claim`). `admit(..., claim=)` turns it into
    the ticket's; `release()` (idempotent; a no-op once admitted) gives the concurrency back. The
    request-rate token is not given back: the router's work on the request was spent."""

    def __init__(self, controller: AdmissionController, tenant: str):
        self._controller = controller
        self.tenant = tenant
        self.done = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self._controller._close(self.tenant)


class TenantPolicy(Protocol):
    """What admission and the fair queue read from a tenant (router.tenants.Tenant, TenantLimits)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def max_concurrency(self) -> int | None: ...
    @property
    def max_queued(self) -> int | None: ...
    @property
    def rate_requests_per_s(self) -> float | None: ...
    @property
    def burst_requests(self) -> float | None: ...
    @property
    def rate_tokens_per_min(self) -> float | None: ...
    @property
    def default_priority(self) -> int: ...


@dataclass(frozen=True)
class TenantLimits:
    name: str
    weight: float = 1.0
    max_concurrency: int | None = None  # open requests: queued + running
    max_queued: int | None = None  # requests waiting in the fair queue
    rate_requests_per_s: float | None = None
    burst_requests: float | None = None  # None: one second's worth, at least 1
    rate_tokens_per_min: float | None = None  # prompt + max_tokens; burst: one minute's worth
    default_priority: int = 0


@dataclass(frozen=True)
class AdmissionConfig:
    max_queued_total: int | None = None  # global queue cap
    max_tokens_in_flight: int | None = None  # cluster budget: prompt + max_tokens of open requests
    default_retry_after_ms: int = 1000  # when no dispatch rate has been measured yet
    max_retry_after_ms: int = 60_000

    def __post_init__(self) -> None:
        assert 1 <= self.default_retry_after_ms <= self.max_retry_after_ms


class Ticket:
    """One admitted request's claim: `release` it when the request ends, however it ends (again: no-op)."""

    def __init__(self, controller: AdmissionController, item: QueuedRequest, num_tokens: int):
        self._controller = controller
        self.item = item
        self.num_tokens = num_tokens  # prompt + max_tokens, held until release
        self.released = False

    def release(self, num_output_tokens: int | None = None, refund_prompt: bool = False) -> None:
        """`refund_prompt`: the request never ran (cancelled or timed out while queued, or failed
        before any output), so its prompt's tokens go back to the tokens/min bucket as well."""
        self._controller._release(self, num_output_tokens, refund_prompt)

    def refused(self) -> None:
        """Released for a refusal after admission (the router's --no-queue: no worker has room):
        the request took nothing, so its prompt + max_tokens go back to the tokens/min bucket."""
        self._controller._release(self, 0, refund_prompt=True)


def request_burst(tenant: TenantPolicy) -> float | None:
    """Requests a tenant may send at once (its request bucket's size): `burst_requests`, by default
    one second's worth and at least one; None without a request rate."""
    rps = tenant.rate_requests_per_s
    if not rps:
        return None
    return tenant.burst_requests or max(1.0, rps)


class AdmissionController:
    def __init__(
        self,
        queue: FairQueue,
        config: AdmissionConfig = AdmissionConfig(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self._queue = queue
        self._config = config
        self._clock = clock
        self._budget = config.max_tokens_in_flight
        self._buckets: dict[str, list[TokenBucket | None]] = {}  # per tenant: [requests/s, tokens/min]
        self._open: Counter[str] = Counter()
        self.tokens_in_flight = 0
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.admitted: Counter[str] = Counter()

    def num_open(self, tenant: str) -> int:
        return self._open[tenant]

    def open_requests(self) -> dict[str, int]:
        """Admitted, not yet released requests per tenant (tenants with none are absent)."""
        return dict(self._open)

    def set_token_budget(self, max_tokens_in_flight: int | None) -> None:
        """The cluster budget may follow the workers' reported KV capacity; None = unlimited."""
        self._budget = max_tokens_in_flight

    def admit(
        self,
        tenant: TenantPolicy,
        num_prompt_tokens: int,
        max_tokens: int,
        *,
        priority: int | None = None,
        deadline_s: float | None = None,
        payload: Any = None,
        claim: Claim | None = None,
    ) -> Ticket:
        """With a `claim` (taken before tokenizing) the request-rate and concurrency checks were
        done then; the claim is consumed either way (refused: released)."""
        if claim is not None and claim.done:
            raise ValueError("admit: the claim was released already")
        item = QueuedRequest(
            tenant.name,
            tenant.weight,
            num_prompt_tokens,
            max_tokens,
            tenant.default_priority if priority is None else priority,
            payload,
        )
        num_tokens = num_prompt_tokens + max_tokens
        requests, tokens = self._tenant_buckets(tenant)
        if claim is not None:
            requests = None  # taken at the claim
        try:
            self._check(tenant, item, num_tokens, requests, tokens, deadline_s, claimed=claim is not None)
        except AdmissionError as err:
            self.refusals[(tenant.name, err.reason)] += 1
            if claim is not None:
                claim.release()
            raise
        for bucket, n in ((requests, 1), (tokens, num_tokens)):
            if bucket is not None:
                taken = bucket.try_take(n)
                assert taken == 0.0, "checked above, on the same clock reading"
        self._queue.push(item)
        if claim is not None:
            claim.done = True  # its open-request count is the ticket's now
        else:
            self._open[tenant.name] += 1
        self.tokens_in_flight += num_tokens
        self.admitted[tenant.name] += 1
        return Ticket(self, item, num_tokens)

    def _check(
        self,
        tenant: TenantPolicy,
        item: QueuedRequest,
        num_tokens: int,
        requests: TokenBucket | None,
        tokens: TokenBucket | None,
        deadline_s: float | None,
        claimed: bool = False,
    ) -> None:
        name, cfg = tenant.name, self._config
        waits = [requests.wait_s(1) if requests else 0.0, tokens.wait_s(num_tokens) if tokens else 0.0]
        if math.isinf(waits[1]):
            raise AdmissionError(
                "rate_limited",
                cfg.max_retry_after_ms,
                f"tenant {name}: the request's {num_tokens} tokens (prompt + max_tokens) "
                f"exceed its limit of {tenant.rate_tokens_per_min:g} tokens per minute",
            )
        if max(waits) > 0:
            raise AdmissionError(
                "rate_limited", self._clamp_ms(max(waits)), f"tenant {name}: rate limit reached"
            )
        self._check_caps(tenant, item.max_cost, self_open=1 if claimed else 0)
        if self._budget is not None and self.tokens_in_flight + num_tokens > self._budget:
            excess = self.tokens_in_flight + num_tokens - self._budget
            if num_tokens > self._budget:
                raise AdmissionError(
                    "token_budget",
                    cfg.max_retry_after_ms,
                    f"request needs {num_tokens} tokens, more than the cluster budget of {self._budget}",
                )
            raise AdmissionError(
                "token_budget",
                self._work_ms(excess * item.max_cost / num_tokens),
                f"cluster token budget spent ({self.tokens_in_flight} of {self._budget} tokens in flight)",
            )
        if deadline_s is not None:
            left_s = deadline_s - self._clock()
            wait_s = self._queue.estimated_wait_s(name, tenant.weight, item.priority)
            if left_s <= 0 or (wait_s is not None and wait_s > left_s):
                estimate = "unknown" if wait_s is None else f"{wait_s * 1e3:.0f} ms"
                raise AdmissionError(
                    "deadline",
                    self._clamp_ms((wait_s or 0.0) - max(left_s, 0.0)),
                    f"estimated queue wait ({estimate}) exceeds the time left "
                    f"before the deadline ({max(left_s, 0.0) * 1e3:.0f} ms)",
                )

    def _check_caps(self, tenant: TenantPolicy, cost: float, self_open: int = 0) -> None:
        """`self_open`: 1 when the request itself is already counted open (a claim)."""
        name, cfg = tenant.name, self._config
        if tenant.max_concurrency is not None and self._open[name] - self_open >= tenant.max_concurrency:
            raise AdmissionError(
                "concurrency",
                self._share_ms(tenant, cost),
                f"tenant {name}: {tenant.max_concurrency} requests already open",
            )
        if tenant.max_queued is not None and self._queue.num_queued(name) >= tenant.max_queued:
            raise AdmissionError(
                "tenant_queue_full",
                self._share_ms(tenant, cost),
                f"tenant {name}: {tenant.max_queued} requests already queued",
            )
        if cfg.max_queued_total is not None and len(self._queue) >= cfg.max_queued_total:
            raise AdmissionError(
                "global_queue_full",
                self._work_ms(cost),
                f"router queue full ({cfg.max_queued_total} requests)",
            )

    def precheck(self, tenant: TenantPolicy, cost: float) -> None:
        """The checks that need no token count (`cost`: an estimate of the request's max_cost)."""
        try:
            self._check_caps(tenant, cost)
        except AdmissionError as err:
            self.refusals[(tenant.name, err.reason)] += 1
            raise

    def gate(self, tenant: TenantPolicy, cost: float) -> None:
        """`claim`'s checks, taking nothing: what a front runs before it reads a request's body,
        so a throttled tenant's request costs a header read."""
        requests, _ = self._tenant_buckets(tenant)
        try:
            wait_s = requests.wait_s(1) if requests else 0.0
            if wait_s > 0:
                raise AdmissionError(
                    "rate_limited", self._clamp_ms(wait_s), f"tenant {tenant.name}: rate limit reached"
                )
            self._check_caps(tenant, cost)
        except AdmissionError as err:
            self.refusals[(tenant.name, err.reason)] += 1
            raise

    def claim(self, tenant: TenantPolicy, cost: float) -> Claim:
        """Before tokenizing: the tenant's request rate (one request taken now, kept even if the
        request is refused later) and the caps of `precheck`; the request then counts as open
        (concurrency) until the claim is released or admitted, so a flood of costly prompts is
        refused before the router tokenizes them, and no more than max_concurrency of one tenant
        are tokenized at once."""
        self.gate(tenant, cost)
        requests, _ = self._tenant_buckets(tenant)
        if requests is not None:
            taken = requests.try_take(1)
            assert taken == 0.0, "checked above, on the same clock reading"
        self._open[tenant.name] += 1
        return Claim(self, tenant.name)

    def refuse(self, tenant: TenantPolicy, reason: str, cost: float, message: str) -> AdmissionError:
        """Counts a refusal the caller decided; returns the error to raise (retry-after from `cost`)."""
        self.refusals[(tenant.name, reason)] += 1
        return AdmissionError(reason, self._work_ms(cost), message)

    def _release(self, ticket: Ticket, num_output_tokens: int | None, refund_prompt: bool = False) -> None:
        if ticket.released:
            return
        ticket.released = True
        item = ticket.item
        self._queue.remove(item)  # no-op once dispatched
        self._close(item.tenant)
        self.tokens_in_flight -= ticket.num_tokens
        tokens = self._buckets.get(item.tenant, (None, None))[1]
        if tokens is not None and num_output_tokens is not None:
            unused = max(0, item.max_tokens - num_output_tokens)
            tokens.give(unused + (item.num_prompt_tokens if refund_prompt else 0))
        self._queue.notify()  # a request ended, so its worker may have room: wake the dispatcher

    def _close(self, tenant: str) -> None:
        self._open[tenant] -= 1
        if self._open[tenant] == 0:
            del self._open[tenant]
        self._queue.notify()

    def _tenant_buckets(self, tenant: TenantPolicy) -> tuple[TokenBucket | None, TokenBucket | None]:
        """The tenant's buckets under the limits its call carries. New limits (a reload) resize them,
        keeping their levels: calls from before and after a reload alternate old and new limits,
        and a fresh, full bucket on each switch handed out a whole allowance each time."""
        rps, tpm = tenant.rate_requests_per_s, tenant.rate_tokens_per_min
        held = self._buckets.setdefault(tenant.name, [None, None])  # kept while a call has no limit
        for i, (rate, burst) in enumerate(((rps, request_burst(tenant)), (tpm and tpm / 60.0, tpm))):
            if rate:
                bucket = held[i]
                held[i] = (
                    TokenBucket(rate, burst, self._clock) if bucket is None else bucket.resized(rate, burst)
                )
        return (held[0] if rps else None), (held[1] if tpm else None)

    def _work_ms(self, units: float) -> int:
        """Time the fleet needs for `units` of max_cost work at the measured dispatch rate."""
        rate = self._queue.dispatch_rate()
        if rate is None:
            return self._config.default_retry_after_ms
        return self._clamp_ms(units / rate)

    def _share_ms(self, tenant: TenantPolicy, units: float) -> int:
        """Like `_work_ms`, at the tenant's weighted share of the rate (it competes for the rest)."""
        idle = self._queue.num_queued(tenant.name) == 0
        weights = self._queue.active_weight() + (tenant.weight if idle else 0.0)
        return self._work_ms(units * weights / tenant.weight)

    def _clamp_ms(self, seconds: float) -> int:
        return int(min(self._config.max_retry_after_ms, max(1, math.ceil(seconds * 1e3))))
