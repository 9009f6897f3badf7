"""The fair queue (VTC) driven against a fake fleet on a fake clock.

The fake fleet: workers with a token capacity like a KV pool (a running request reserves
prompt + max_tokens); every tick each running request generates one token, which is charged to
its tenant's counter at once; a request finishes after its own output length (<= max_tokens).

The bound (docs/fairness.md, section 3). Service W = (input tokens + 2 x output tokens) / weight;
for a tenant that stays backlogged its counter grows by exactly its service (lifts only happen
to idle tenants). Let D = c_f - c_g for two backlogged tenants. When f is dispatched it was
either the smallest counter (D <= 0) or g's head was blocked and f led g by less than that head's
cost (D < C_max, the largest request cost, max_cost / weight). The dispatch adds f's prompt, and
until f's next dispatch c_f grows only by the output of f's requests already running, while c_g
never shrinks. The prompt plus twice the output still to come of everything running is at most
2K, K being the fleet's token capacity. So |D| <= U = (C_max + 2K) / w_min at all times, and over
any window |W_f - W_g| <= 2U; from a common start (D = 0), |W_f - W_g| <= U.
Here K = 2 x 256, C_max = 64 + 2 x 64 = 192, w_min = 1: U = 1216 weighted tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from router.fair_queue import OUTPUT_COST, FairQueue, QueuedRequest

TICK_S = 0.01
WORKER_TOKENS = 256
NUM_WORKERS = 2
MAX_PROMPT, MAX_OUT = 64, 64
C_MAX = MAX_PROMPT + OUTPUT_COST * MAX_OUT


def bound_u(w_min: float, c_max: float = C_MAX, k: int = NUM_WORKERS * WORKER_TOKENS) -> float:
    return (c_max + 2 * k) / w_min


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class FakeWorker:
    capacity_tokens: int
    running: list[list] = field(default_factory=list)  # [item, output tokens still to generate]

    def free(self) -> int:
        return self.capacity_tokens - sum(i.num_prompt_tokens + i.max_tokens for i, _ in self.running)

    def has_room(self, item: QueuedRequest) -> bool:
        return item.num_prompt_tokens + item.max_tokens <= self.free()


class Sim:
    """Arrivals -> fair queue -> fake workers; `service` is the raw cost each tenant received."""

    def __init__(
        self,
        mode: str = "vtc",
        hold_for_blocked: bool = True,
        seed: int = 0,
        worker_tokens: int = WORKER_TOKENS,
    ):
        self.clock = FakeClock()
        self.queue = FairQueue(self.clock, mode=mode, hold_for_blocked=hold_for_blocked)
        self.workers = [FakeWorker(worker_tokens) for _ in range(NUM_WORKERS)]
        self.rng = random.Random(seed)
        self.service: dict[str, float] = defaultdict(float)
        self.dispatched: dict[str, int] = defaultdict(int)
        self._due: dict[str, float] = defaultdict(float)

    def request(self, tenant: str, weight: float, prompt=None, max_tokens=None) -> QueuedRequest:
        prompt = prompt or self.rng.randint(16, MAX_PROMPT)
        max_tokens = max_tokens or self.rng.randint(16, MAX_OUT)
        out_len = self.rng.randint(max_tokens // 2, max_tokens)
        return QueuedRequest(tenant, weight, prompt, max_tokens, payload=out_len)

    def arrive(self, tenant: str, weight: float, per_tick: float, **shape) -> None:
        self._due[tenant] += per_tick
        while self._due[tenant] >= 1:
            self._due[tenant] -= 1
            self.queue.push(self.request(tenant, weight, **shape))

    def prefill(self, senders: dict[str, tuple[float, float]], num_each: int = 20) -> None:
        """A backlog for every sender at time 0, so that all of them are backlogged from the start."""
        for tenant, (weight, _) in senders.items():
            for _ in range(num_each):
                self.queue.push(self.request(tenant, weight))

    def dispatch(self) -> None:
        while item := self.queue.pop_next(lambda it: any(w.has_room(it) for w in self.workers)):
            worker = max((w for w in self.workers if w.has_room(item)), key=FakeWorker.free)
            worker.running.append([item, item.payload])
            self.service[item.tenant] += item.num_prompt_tokens
            self.dispatched[item.tenant] += 1

    def decode(self) -> None:
        for w in self.workers:
            for entry in w.running:
                entry[1] -= 1
                self.queue.charge_output(entry[0].tenant, 1)
                self.service[entry[0].tenant] += OUTPUT_COST
            w.running = [e for e in w.running if e[1] > 0]
        self.clock.now_s += TICK_S

    def tick(self, senders: dict[str, tuple[float, float]]) -> None:
        """senders: tenant -> (weight, requests per tick)."""
        for tenant, (weight, rate) in senders.items():
            self.arrive(tenant, weight, rate)
        self.dispatch()
        self.decode()


def gaps(sim: Sim, senders: dict[str, tuple[float, float]], ticks: int, a: str = "a", b: str = "b"):
    """Run; return the weighted service gap W_a - W_b after each tick (both must stay backlogged)."""
    wa, wb = senders[a][0], senders[b][0]
    sim.prefill(senders)
    out = []
    for _ in range(ticks):
        sim.tick(senders)
        assert sim.queue.num_queued(a) and sim.queue.num_queued(b), "the bound needs both backlogged"
        out.append(sim.service[a] / wa - sim.service[b] / wb)
    return out


def test_ten_times_the_rate_gets_equal_service_within_the_bound():
    senders = {"a": (1.0, 5.0), "b": (1.0, 0.5)}  # a sends 10x b's requests; both far above capacity
    sim = Sim()
    d = gaps(sim, senders, ticks=1500)
    u = bound_u(w_min=1.0)
    print(
        f"\nVTC 1:1, 10x rate: max |W_a - W_b| = {max(map(abs, d)):.0f}, window max "
        f"{max(d) - min(d):.0f}; bound U = {u:.0f} (windows 2U = {2 * u:.0f}); "
        f"service a={sim.service['a']:.0f} b={sim.service['b']:.0f}"
    )
    assert max(map(abs, d)) <= u
    assert max(d) - min(d) <= 2 * u
    sim.queue.check_integrity()

    fcfs = Sim(mode="fcfs")  # the control: without fairness the heavy sender takes ~10/11
    d_fcfs = gaps(fcfs, senders, ticks=1500)
    print(
        f"FCFS control: W_a - W_b = {d_fcfs[-1]:.0f}, "
        f"service a/b = {fcfs.service['a'] / fcfs.service['b']:.1f}"
    )
    assert d_fcfs[-1] > 10 * u
    assert fcfs.service["a"] > 4 * fcfs.service["b"]


def test_weights_two_to_one_split_service_two_to_one():
    senders = {"a": (2.0, 0.5), "b": (1.0, 5.0)}  # weight, not rate, decides: b sends 10x more
    sim = Sim(seed=1)
    d = gaps(sim, senders, ticks=4000)
    ratio = sim.service["a"] / sim.service["b"]
    print(
        f"\nVTC 2:1: service a/b = {ratio:.3f}, max |W_a - W_b| = {max(map(abs, d)):.0f} "
        f"(bound {bound_u(w_min=1.0):.0f})"
    )
    assert 1.8 <= ratio <= 2.2
    assert max(map(abs, d)) <= bound_u(w_min=1.0)


def capped_poisson_run(b_offer: float, cap: int, ticks: int = 6000, seed: int = 5) -> dict:
    """The shape of `make bench-fairness`: equal requests (32 prompt + 16 output tokens), Poisson
    arrivals, a (weight 1) sending 2x b (weight 2), each tenant's queue capped at `cap` (admission's
    max_queued: the rest is refused). `b_offer`: b's offered requests / the fleet's capacity."""
    sim = Sim(seed=seed)
    shape = {"prompt": 32, "max_tokens": 16}
    fits = NUM_WORKERS * (WORKER_TOKENS // 48)
    capacity = fits / 16  # requests per tick: `fits` requests of 16 decode ticks each
    rates = {"a": 2 * b_offer * capacity, "b": b_offer * capacity}
    weights = {"a": 1.0, "b": 2.0}
    backlogged = {"a": 0, "b": 0}
    both, gap, lo, hi = 0, 0.0, 0.0, 0.0
    for _ in range(ticks):
        for name, rate in rates.items():
            for _ in range(poisson(sim.rng, rate)):
                if sim.queue.num_queued(name) < cap:
                    item = sim.request(name, weights[name], **shape)
                    item.payload = 16  # ignore_eos, as the benchmark: every request makes 16 tokens
                    sim.queue.push(item)
        before = {n: sim.service[n] for n in rates}
        queued = {n: sim.queue.num_queued(n) > 0 for n in rates}
        sim.dispatch()
        sim.decode()
        for n in rates:
            backlogged[n] += queued[n]
        if all(queued.values()):  # both backlogged this tick: count toward the ratio and the swing
            both += 1
            gap += (sim.service["a"] - before["a"]) / 1.0 - (sim.service["b"] - before["b"]) / 2.0
            lo, hi = min(lo, gap), max(hi, gap)
        else:
            gap = lo = hi = 0.0
    return {
        "ratio": sim.service["b"] / sim.service["a"],
        "both": both / ticks,
        "swing": hi - lo,
        "b_backlogged": backlogged["b"] / ticks,
    }


def poisson(rng: random.Random, mean: float) -> int:
    n, t = 0, rng.expovariate(1.0)
    while t < mean:
        n, t = n + 1, t + rng.expovariate(1.0)
    return n


@pytest.mark.parametrize("b_offer", [1.0, 2.0])
def test_capped_poisson_tenants_get_their_weights_while_backlogged(b_offer):
    """b (weight 2) offers 1.5x resp. 3x its fair share (2/3 of the fleet): both tenants stay
    backlogged and b gets twice a's service within 10%; the swing of W_a - W_b within a backlogged
    stretch stays within the bound 2U of docs/fairness.md section 3 (K = 512, C = 48)."""
    got = capped_poisson_run(b_offer, cap=16)
    u = bound_u(w_min=1.0, c_max=48)
    print(
        f"\nb offers {b_offer:g}x the fleet, cap 16: b / a service {got['ratio']:.3f}, both backlogged "
        f"{got['both']:.0%}, swing {got['swing']:.0f} (2U = {2 * u:.0f})"
    )
    assert got["both"] > 0.9
    assert 1.8 <= got["ratio"] <= 2.2
    assert got["swing"] <= 2 * u


def test_a_tenant_whose_capped_queue_runs_dry_gets_what_it_asks_not_its_weight():
    """The old benchmark's set-up (queues capped at 4, b offering 0.75x the fleet, 1.1x its share):
    between Poisson bursts b's queue runs empty and its refused overflow is lost, so b / a falls
    well under 2 (the benchmark measured 1.29), although VTC serves b first whenever it waits;
    counting only the ticks in which both wait does not repair it (~1.6: the requests running
    then were dispatched before). So `make bench-fairness` calibrates its load and reads the
    ratio only when a and b were both backlogged nearly all the time (>= 95%)."""
    starved = capped_poisson_run(0.75, cap=4)
    print(
        f"\ncap 4, b offers 0.75x: b / a service {starved['ratio']:.2f}, "
        f"b backlogged {starved['b_backlogged']:.0%}, both {starved['both']:.0%}"
    )
    assert starved["both"] < 0.95
    assert starved["ratio"] < 1.8


def test_returning_tenant_gets_no_banked_credit():
    sim = Sim(seed=2)
    for _ in range(1000):  # a alone: its counter climbs while b is idle
        sim.tick({"a": (1.0, 1.0)})
    assert sim.queue.counter("a") > 10 * bound_u(1.0)  # credit b would bank without the lift
    sim.queue.push(sim.request("b", 1.0))
    assert sim.queue.counter("b") == sim.queue.counter("a")  # lifted to the active minimum
    before = dict(sim.service)
    d = []
    for _ in range(1000):
        sim.tick({"a": (1.0, 1.0), "b": (1.0, 1.0)})
        assert sim.queue.num_queued("a") and sim.queue.num_queued("b")
        d.append((sim.service["b"] - before.get("b", 0.0)) - (sim.service["a"] - before["a"]))
    print(
        f"\nreturn from idle: b's lead over a after its return peaks at {max(d):.0f} "
        f"(bound {bound_u(1.0):.0f})"
    )
    assert max(map(abs, d)) <= bound_u(1.0)


def test_lift_without_active_tenants_uses_the_last_served_counter():
    clock = FakeClock()
    q = FairQueue(clock)
    for _ in range(3):
        q.push(QueuedRequest("a", 1.0, 100, 10))
        assert q.pop_next(lambda _: True) is not None
    q.charge_output("a", 10)
    assert len(q) == 0 and q.counter("a") == 320
    q.push(QueuedRequest("b", 1.0, 5, 5))
    assert q.counter("b") == 320


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_single_tenant_gets_the_whole_fleet(weight):
    sim = Sim(seed=3)
    sim.prefill({"a": (weight, 1.0)})
    used = []
    for _ in range(500):
        sim.arrive("a", weight, 1.0)
        sim.dispatch()
        assert len(sim.queue) > 0, "the tenant must stay backlogged"
        head_fits = sim.queue.pop_next(lambda it: any(w.has_room(it) for w in sim.workers))
        assert head_fits is None, "work left in the queue although a worker had room for it"
        used.append(sum(WORKER_TOKENS - w.free() for w in sim.workers) / (NUM_WORKERS * WORKER_TOKENS))
        sim.decode()
    print(f"\nsingle tenant (weight {weight}): mean fleet token usage {sum(used) / len(used):.3f}")
    assert sum(used) / len(used) > 0.8  # what is left is fragments smaller than the head request


def test_a_large_request_is_not_starved_by_small_ones():
    """b's small requests keep some room taken; a's request needs a whole worker."""
    big = {"prompt": 200, "max_tokens": 50}
    small = {"prompt": 16, "max_tokens": 16}

    def run(hold: bool) -> Sim:
        sim = Sim(hold_for_blocked=hold, seed=4)
        for _ in range(1000):
            sim.arrive("a", 1.0, 0.2, **big)
            sim.arrive("b", 1.0, 3.0, **small)
            sim.dispatch()
            sim.decode()
        return sim

    held, free_for_all = run(hold=True), run(hold=False)
    print(
        f"\nlarge requests served: with hold {held.dispatched['a']}, without {free_for_all.dispatched['a']}"
    )
    assert free_for_all.dispatched["a"] <= 2
    assert held.dispatched["a"] >= 20
    assert held.service["a"] >= 0.3 * held.service["b"]


def test_within_a_tenant_priority_then_arrival():
    q = FairQueue(FakeClock())
    items = [QueuedRequest("a", 1.0, 1, 1, priority=p, payload=n) for n, p in enumerate([0, 5, 0, 5, 1])]
    for item in items:
        q.push(item)
    order = [q.pop_next(lambda _: True).payload for _ in items]
    assert order == [1, 3, 4, 0, 2]
    assert q.pop_next(lambda _: True) is None


def test_smallest_counter_first_and_blocked_heads_are_skipped():
    q = FairQueue(FakeClock(), hold_for_blocked=False)
    q.push(QueuedRequest("a", 1.0, 50, 1))
    q.push(QueuedRequest("b", 1.0, 10, 1))
    assert q.pop_next(lambda _: True).tenant == "a"  # equal counters: older head
    q.push(QueuedRequest("a", 1.0, 10, 1))
    assert q.pop_next(lambda _: True).tenant == "b"  # a's counter is now 50, b's 0
    assert q.counters() == {"a": 50, "b": 10}
    big = QueuedRequest("b", 1.0, 500, 1)
    q.push(big)
    got = q.pop_next(lambda it: it is not big)  # b has the smaller counter, but its head does not fit
    assert got.tenant == "a"


def test_fcfs_mode_ignores_counters():
    q = FairQueue(FakeClock(), mode="fcfs")
    for tenant in "aab":
        q.push(QueuedRequest(tenant, 1.0, 100, 1))
    assert [q.pop_next(lambda _: True).tenant for _ in range(3)] == ["a", "a", "b"]


def test_remove_cancels_and_deactivates():
    q = FairQueue(FakeClock())
    a1, a2, b1 = QueuedRequest("a", 1.0, 1, 1), QueuedRequest("a", 1.0, 1, 1), QueuedRequest("b", 1.0, 1, 1)
    for item in (a1, a2, b1):
        q.push(item)
    assert q.remove(a1) and not q.remove(a1)
    q.check_integrity()
    assert q.pop_next(lambda _: True) is a2
    assert q.remove(b1)
    assert len(q) == 0 and q.pop_next(lambda _: True) is None
    assert not q.remove(a2)  # already dispatched
    q.check_integrity()
    with pytest.raises(ValueError):
        q.push(QueuedRequest("c", 0.0, 1, 1))


def test_dispatcher_wakes_on_push_and_capacity_change_without_polling():
    async def scenario() -> list[str]:
        q = FairQueue(FakeClock())
        woke: list[str] = []

        async def dispatcher() -> None:
            while True:
                await q.wait_for_change()
                woke.append(f"queued={len(q)}")

        task = asyncio.create_task(dispatcher())
        for _ in range(5):
            await asyncio.sleep(0)
        assert woke == []  # nothing happened: the dispatcher sleeps
        q.push(QueuedRequest("a", 1.0, 1, 1))
        for _ in range(5):
            await asyncio.sleep(0)
        q.notify()  # e.g. a worker's load report showed free blocks
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        return woke

    assert asyncio.run(scenario()) == ["queued=1", "queued=1"]
