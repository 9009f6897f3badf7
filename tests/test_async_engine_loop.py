"""AsyncEngine's loop (worker/async_engine.py) with real engines on the tiny model: an engine
thread that waits, not spins, while parked streams hold every slot, and that outlives a failing
step observer; a request id reused right after its client left gets its own outputs, not the
earlier request's (both schedulers where it matters)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.test_async_scheduling import tiny_config, tiny_runner
from worker.async_engine import AsyncEngine
from worker.engine import LLMEngine
from worker.types import SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parked_streams_holding_every_slot_do_not_make_the_engine_spin(async_scheduling):
    """Both of max_num_seqs=2 slots are held by sequences whose readers are behind (parked: no
    compute) and a third request waits for a slot: nothing can run until a reader takes something.
    The engine thread waits for that instead of stepping in a loop (it made ~100,000 empty steps a
    second: one core busy, and the GIL taken from the event loop that serves the streams); once
    the readers read, every request finishes and every block is free."""
    config = dataclasses.replace(
        tiny_config(num_kv_blocks=128, max_num_seqs=2), async_scheduling=async_scheduling
    )
    engine = LLMEngine(config, runner=tiny_runner(config))
    served = AsyncEngine(engine, stream_buffer=1)
    calls = [0]
    step = engine.step

    def counted_step():
        calls[0] += 1
        return step()

    engine.step = counted_step
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main() -> tuple[int, list[int]]:
        go = asyncio.Event()

        async def reader(rid: str, hold: bool) -> int:
            n = 0
            async for out in served.generate(rid, [1, 2, 3, 4, 5], sp):
                n += len(out.new_token_ids)
                if hold:
                    await go.wait()  # behind: takes nothing more until told
            return n

        tasks = [asyncio.create_task(reader(rid, True)) for rid in ("a", "b")]
        deadline = time.monotonic() + 30
        while not all(s.paused for s in served._streams.values()) or len(served._streams) < 2:
            assert time.monotonic() < deadline, "the two streams never parked"
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(reader("c", False)))  # waits: both slots are held
        while "c" not in engine.scheduler.requests:
            assert time.monotonic() < deadline, "the third request never arrived"
            await asyncio.sleep(0.01)
        before = calls[0]
        await asyncio.sleep(0.5)  # a window to count the engine's steps in, not a synchronization
        idle_calls = calls[0] - before
        go.set()
        return idle_calls, await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    served.start()
    try:
        idle_calls, tokens = asyncio.run(main())
    finally:
        served.shutdown()
    assert tokens == [5, 5, 5]
    assert idle_calls <= 10, idle_calls  # a wake-up a second, at most a few steps each
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_id_reused_after_its_client_left_gets_its_own_outputs(async_scheduling):
    """A client cancels request X after its first token and retries under the same id at once (the
    worker API allows it). The first X's abort output, and any of its outputs still on the way, must
    not reach the second X's stream: that ended the retry at once with finish ABORT while the second
    X ran on in the engine, unread, holding its blocks until max_tokens."""
    config = dataclasses.replace(tiny_config(num_kv_blocks=64), async_scheduling=async_scheduling)
    engine = LLMEngine(config, runner=tiny_runner(config))
    served = AsyncEngine(engine)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        first = served.generate("X", [1, 2, 3, 4], dataclasses.replace(sp, max_tokens=40))
        async for _ in first:
            break  # one token, then the client goes
        await first.aclose()
        return [out async for out in served.generate("X", [5, 6, 7, 8], sp)]

    served.start()
    try:
        outs = asyncio.run(main())
    finally:
        served.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == 12 and outs[-1].finish_reason == "length", outs[-1]
    assert "X" not in engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failing_step_observer_does_not_stop_the_engine_thread():
    """A step observer (the step histograms) that raises is logged; the engine thread goes on
    and every request gets all its tokens (an exception there ended the thread: every open and
    later request then waited for ever)."""
    config = tiny_config(num_kv_blocks=64)
    engine = LLMEngine(config, runner=tiny_runner(config))
    served = AsyncEngine(engine)
    calls = [0]

    def broken(engine, outputs):
        calls[0] += 1
        raise RuntimeError("observer bug")

    served.step_observers.append(broken)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> list[int]:
        async def one(rid: str) -> int:
            return sum([len(out.new_token_ids) async for out in served.generate(rid, [1, 2, 3], sp)])

        return await asyncio.wait_for(asyncio.gather(one("a"), one("b")), timeout=20)

    served.start()
    try:
        assert asyncio.run(main()) == [6, 6]
        assert asyncio.run(main()) == [6, 6]  # and later requests too
    finally:
        served.shutdown()
    assert calls[0] >= 6
