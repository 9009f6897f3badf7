"""The router's grammar compiles (router/grammar_compile.py): a wall-clock budget enforced by killing
the compile process, a cache of successes and refusals, and a bounded share per tenant.

The slow schema: a 600-byte `json_schema` whose `allOf` holds 14 string patterns `.*aN.*`
(llguidance works ~3.5x longer per extra pattern, then refuses it: 8 s on an idle machine, minutes
on a busy one). On the old code the router compiled it on its one compile thread with no bound: the
refusal came after those seconds, a cheap `json_object` compile queued behind it, and a repeat cost
the same again (a refusal was not cached)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

pytest.importorskip("llguidance")

from protos.llm.v1 import generation_pb2 as pb  # noqa: E402
from router.errors import Overloaded, ValidationError  # noqa: E402
from router.grammar_compile import GrammarCompiler  # noqa: E402
from tests.router_harness import Router, ScriptedWorker, tokens  # noqa: E402


def slow_schema(patterns: int = 14, letter: str = "a") -> str:
    return json.dumps(
        {"allOf": [{"type": "string", "pattern": f".*{letter}{i}.*"} for i in range(1, patterns + 1)]}
    )


SLOW = ("format", "json_schema", slow_schema())
JSON_OBJECT = ("format", "json_object", "")
MARGIN_S = 2.0  # the refusal's time past the budget at most: the kill, and a loaded 2-CPU machine
# a chain of 3,500 rules: llguidance recurses past a default 8 MB stack (SIGSEGV) unless the compile
# runs on a deep-stack thread (common.structured.DEEP_STACK_BYTES), in the child too
DEEP = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3500)) + 'r3500: "z"\n'


@pytest.fixture
def compiler():
    made = []

    def make(**kw) -> GrammarCompiler:
        made.append(GrammarCompiler(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _request(**fmt) -> pb.GenerateRequest:
    r = pb.GenerateRequest(response_format=pb.ResponseFormat(**fmt))
    r.token_ids.ids.extend((1, 2, 3, 4))
    r.stopping.max_tokens = 4
    return r


async def _timed(coro):
    """(result or exception, seconds it took)."""
    start = time.monotonic()
    try:
        out = await coro
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer under test
        out = exc
    return out, time.monotonic() - start


async def _compiling(router: Router, slow: asyncio.Task, deadline_s: float = 10.0) -> None:
    """Returns once the slow request's compile went to a process (or the request ended)."""
    pool = router.service._grammars.pool
    end = time.monotonic() + deadline_s
    while pool.tasks == 0 and not slow.done():
        assert time.monotonic() < end, "the slow compile did not start"
        await asyncio.sleep(0.01)


def test_the_slow_schema_is_refused_within_its_budget_and_a_json_object_beside_it_is_served():
    """End to end through the service (scripted worker): the slow schema is INVALID_ARGUMENT naming
    the budget within budget + margin; a json_object request sent beside it gets its tokens while
    the slow compile still runs (the old code: ~8 s or more for each, the cheap one behind it)."""
    budget = 1.5

    async def main():
        router = await Router.create(
            [ScriptedWorker()],
            grammar_compile_timeout_s=budget,
            grammar_compile_processes=3,
            grammar_compiles_per_tenant=2,
        )
        try:
            slow = asyncio.create_task(_timed(router.generate(_request(json_schema=slow_schema()))))
            await _compiling(router, slow)  # the cheap one comes while the slow one compiles
            (out, err), cheap_s = await _timed(router.generate(_request(json_object=True)))
            slow_running = not slow.done()
            (_, slow_err), slow_s = await slow
            return out, err, cheap_s, slow_running, slow_err, slow_s, router.service._grammars.pool.killed
        finally:
            await router.close()
            router.service._grammars.close()

    out, err, cheap_s, slow_running, slow_err, slow_s, killed = asyncio.run(main())
    assert err is None and tokens(out), err
    assert slow_running and cheap_s < budget, (cheap_s, slow_s)
    assert isinstance(slow_err, ValidationError), slow_err
    assert str(slow_err) == (
        f"response_format.json_schema: the grammar did not compile within {budget} s (its compile budget)"
    )
    assert budget <= slow_s < budget + MARGIN_S and killed == 1, slow_s


def test_a_repeated_failing_schema_is_answered_from_the_cache(compiler):
    """Both kinds of refusal: over the budget (its process killed) and llguidance's own error; the
    repeat sends no task to a process and takes no time."""
    c = compiler(budget_s=0.5, processes=1)

    async def main():
        first = await _timed(c.compile(SLOW, "a"))
        tasks = c.pool.tasks
        again = await _timed(c.compile(SLOW, "b"))  # another tenant: the cache is the router's
        bad = ("format", "json_schema", '{"type": "nope"}')
        refused = await _timed(c.compile(bad, "a"))
        tasks_after_bad = c.pool.tasks
        refused_again = await _timed(c.compile(bad, "a"))
        return first, again, tasks, refused, refused_again, tasks_after_bad

    first, again, tasks, refused, refused_again, tasks_after_bad = asyncio.run(main())
    assert isinstance(first[0], ValueError) and "within 0.5 s (its compile budget)" in str(first[0])
    assert 0.5 <= first[1] < 0.5 + MARGIN_S, first
    assert str(again[0]) == str(first[0]) and again[1] < 0.05, again
    assert isinstance(refused[0], ValueError) and str(refused_again[0]) == str(refused[0])
    assert refused_again[1] < 0.05 and c.pool.tasks == tasks_after_bad == tasks + 1, (
        refused_again,
        c.pool.tasks,
    )
    assert c.pool.killed == 1
    assert c.counts == {"timeout": 1, "error": 1, "cached": 2}  # llm_router_grammar_compiles_total


def test_successes_are_cached_and_concurrent_equal_compiles_share_one(compiler):
    c = compiler(budget_s=5.0, processes=2)
    schema = ("format", "json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}}')

    async def main():
        together = await asyncio.gather(*(c.compile(schema, "a") for _ in range(4)))
        tasks = c.pool.tasks
        again, seconds = await _timed(c.compile(schema, "b"))
        return together, tasks, again, seconds

    together, tasks, again, seconds = asyncio.run(main())
    assert len(set(together)) == 1 and json.loads(together[0]) and again == together[0]
    assert tasks == 1 and c.pool.tasks == 1 and seconds < 0.05
    assert c.counts == {"ok": 1, "shared": 3, "cached": 1}


def test_a_tenants_share_is_bounded_and_leaves_room_for_others(compiler):
    """Tenant a may run one compile at a time: its second slow schema waits wait_s, then is refused
    (RESOURCE_EXHAUSTED) while its first still runs; tenant b's json_object is served meanwhile."""
    c = compiler(budget_s=3.0, processes=2, per_tenant=1, wait_s=0.5)

    async def main():
        first = asyncio.create_task(_timed(c.compile(SLOW, "a")))
        second = asyncio.create_task(
            _timed(c.compile(("format", "json_schema", slow_schema(letter="b")), "a"))
        )
        other = await _timed(c.compile(JSON_OBJECT, "b"))
        refused = await second
        first_running = not first.done()
        return await first, refused, other, first_running

    first, refused, other, first_running = asyncio.run(main())
    assert isinstance(refused[0], Overloaded), refused
    assert "1 at a time" in refused[0].message and refused[0].retry_after_ms == 3000, refused[0].message
    assert 0.5 <= refused[1] < 0.5 + MARGIN_S and first_running, (refused, first)
    assert json.loads(other[0]) and other[1] < 3.0, other
    assert "within 3.0 s (its compile budget)" in str(first[0])


def test_the_killed_process_is_replaced_and_the_pool_keeps_serving(compiler):
    """After a kill: cheap compiles, and a grammar that needs the deep stack in the child, are served;
    no more processes live than the pool's size."""
    c = compiler(budget_s=0.5, processes=2, per_tenant=2, wait_s=10.0)

    async def main():
        refused = await _timed(c.compile(SLOW, "a"))
        served = await asyncio.gather(
            c.compile(JSON_OBJECT, "a"),
            c.compile(("format", "regex", "[a-z]+"), "b"),
            c.compile(("format", "grammar", DEEP), "c"),
            c.compile(("format", "choice", '["yes", "no"]'), "d"),
        )
        return refused, served

    refused, served = asyncio.run(main())
    assert "its compile budget" in str(refused[0]) and c.pool.killed == 1
    assert all(served) and c.pool.started >= 2, c.pool.started
    live = [child for child in c.pool._all if child.proc.poll() is None]
    assert len(live) == len(c.pool._all) <= 2


def test_a_process_that_dies_on_a_grammar_is_a_refusal_and_is_replaced(compiler):
    """A child that dies mid-compile (as a stack overflow would: SIGSEGV) refuses that grammar, not
    the router; the next compile gets a new process."""
    c = compiler(budget_s=30.0, processes=1)

    async def main():
        slow = asyncio.create_task(_timed(c.compile(SLOW, "a")))
        end = time.monotonic() + 10.0
        while c.pool.tasks == 0:
            assert time.monotonic() < end, "the compile did not start"
            await asyncio.sleep(0.01)
        (child,) = c.pool._all
        child.proc.send_signal(signal.SIGSEGV)
        died = await slow
        return died, await c.compile(JSON_OBJECT, "a")

    (err, seconds), served = asyncio.run(main())
    assert isinstance(err, ValueError) and str(err) == "the grammar compiler failed on this grammar"
    assert seconds < 10.0 and json.loads(served) and c.pool.killed == 1 and c.pool.started >= 2
    assert len(c.pool._all) <= 1  # a replacement started beside the next compile: one is kept


def test_the_think_block_form_goes_through_the_compiler_and_its_cache(compiler):
    from common.structured import grammar_for

    c = compiler(budget_s=5.0, processes=1)
    grammar = grammar_for({"type": "json_object"})
    task = ("think", grammar, True, 5, 6)

    async def main():
        return await c.compile(task, "a"), await c.compile(task, "b")

    wrapped, again = asyncio.run(main())
    assert wrapped == again and "think_then_answer" in wrapped and c.pool.tasks == 1


def test_a_compile_past_its_memory_budget_is_a_refusal(compiler):
    """`memory_bytes`: the child's address space is capped at what it held when ready plus the
    budget; the slow schema grows past 32 MB long before its time runs out, its child ends, and
    the grammar is refused (and cached); a small grammar still compiles within that budget."""
    c = compiler(budget_s=60.0, processes=1, memory_bytes=32 * 2**20)

    async def main():
        return await _timed(c.compile(SLOW, "a")), await c.compile(JSON_OBJECT, "a")

    (err, seconds), served = asyncio.run(main())
    assert isinstance(err, ValueError) and str(err) == "the grammar compiler failed on this grammar", err
    assert seconds < 30.0 and c.counts["crashed"] == 1 and json.loads(served)
