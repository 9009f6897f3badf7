"""The worker's stream interval (--stream-interval N, worker/async_engine.py): after a stream's
first tokens, tokens are delivered N at a time; the finishing output carries the rest at once.
In process on a tiny random Llama (an AsyncEngine per interval over the same weights): the tokens
and logprobs are those of interval 1, only cut into fewer messages; an aborted stream frees its
blocks even with tokens held; a bad interval is refused with its name.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.test_async_scheduling import tiny_config, tiny_runner
from worker import __main__ as worker_main
from worker.async_engine import AsyncEngine
from worker.engine import LLMEngine
from worker.types import SamplingParams

PROMPTS = {"a": [5, 9, 2, 7], "b": [11, 3, 8, 1, 4, 6], "c": [2, 2]}
SAMPLING = {
    "a": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    "b": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=True),
    "c": SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
}


def stream_all(interval: int, async_scheduling: bool = False) -> dict[str, list]:
    """Each request's outputs (token ids, logprobs, finished) as delivered, all three at once. The
    engine thread starts once all three requests are posted, so every run batches them the same way
    (float32 matmuls are not batch-invariant in the last bits: the logprobs are compared exactly)."""
    config = tiny_config(async_scheduling=async_scheduling)
    engine = AsyncEngine(LLMEngine(config, runner=tiny_runner(config)), stream_interval=interval)

    async def one(rid: str) -> list:
        return [
            (list(o.new_token_ids), list(o.new_logprobs or ()), o.finished)
            async for o in engine.generate(rid, PROMPTS[rid], SAMPLING[rid])
        ]

    async def main() -> dict[str, list]:
        tasks = [asyncio.ensure_future(one(rid)) for rid in PROMPTS]
        await asyncio.sleep(0)  # one turn of the loop: each task runs to its first await, posting its add
        assert [c[0] for c in engine._commands] == ["add"] * len(PROMPTS)
        engine.start()
        results = await asyncio.gather(*tasks)
        return dict(zip(PROMPTS, results))

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def flat(messages: list) -> tuple[list[int], list[float]]:
    return [t for m in messages for t in m[0]], [lp for m in messages for lp in m[1]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_interval_cuts_the_same_tokens_into_fewer_messages(async_scheduling):
    every = stream_all(1, async_scheduling)
    held = stream_all(3, async_scheduling)
    for rid in PROMPTS:
        assert flat(held[rid]) == flat(every[rid]), rid  # same tokens, same logprobs, same order
        assert [len(m[0]) for m in every[rid]] == [1] * SAMPLING[rid].max_tokens, rid
        sizes = [len(m[0]) for m in held[rid]]
        assert sizes[0] == 1, (rid, sizes)  # the first token at once (TTFT unchanged)
        assert all(size == 3 for size in sizes[1:-1]), (rid, sizes)
        assert 1 <= sizes[-1] <= 3 and held[rid][-1][2], (rid, sizes)  # the finishing output: the rest
        assert not any(m[2] for m in held[rid][:-1])
        assert len(held[rid]) == 1 + -(-(SAMPLING[rid].max_tokens - 1) // 3), (rid, sizes)
    lps = flat(held["b"])[1]
    assert len(lps) == len(flat(held["b"])[0]) and all(lp <= 0 for lp in lps)


def test_abandoned_stream_with_held_tokens_frees_every_block():
    config = tiny_config()
    engine = AsyncEngine(LLMEngine(config, runner=tiny_runner(config)), stream_interval=4)
    engine.start()
    blocks = engine.engine.block_manager

    async def main() -> list[list[int]]:
        got = []
        async for out in engine.generate("x", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=40)):
            got.append(out.new_token_ids)
            if len(got) == 2:
                break  # the generator is closed (asyncio.run's shutdown_asyncgens at the latest): abort
        return got

    try:
        got = asyncio.run(main())
        assert [len(ids) for ids in got] == [1, 4]
        deadline = asyncio.run(_wait_free(engine, blocks, timeout_s=10.0))
        assert deadline, f"{blocks.num_free_blocks} of {blocks.num_blocks} blocks free after 10 s"
    finally:
        engine.shutdown()


async def _wait_free(engine: AsyncEngine, blocks, timeout_s: float) -> bool:
    """True once every block is back in the pool (the engine thread aborts within a step)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if blocks.num_free_blocks == blocks.num_blocks and not engine.engine.has_unfinished_requests():
            return True
        await asyncio.sleep(0.01)
    return False


def test_bad_interval_is_refused_with_its_name(capsys):
    assert worker_main.parse_args(["--stream-interval", "4"]).stream_interval == 4
    assert worker_main.parse_args([]).stream_interval == 1  # every token as it is sampled
    with pytest.raises(SystemExit) as exc:
        worker_main.parse_args(["--stream-interval", "0"])
    assert exc.value.code == 2 and "stream_interval must be >= 1, got 0" in capsys.readouterr().err
    config = tiny_config()
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got -2"):
        AsyncEngine(LLMEngine(config, runner=tiny_runner(config)), stream_interval=-2)
