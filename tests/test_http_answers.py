"""Whole JSON answers of the HTTP front (router/openai/http.py `json_answer`): the same bytes as
Starlette's JSONResponse, and a large one built and encoded without holding the event loop."""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse

from router.openai.http import LARGE_ANSWER_ENTRIES, json_answer


def logprobs_answer(tokens: int, top: int) -> dict:
    """An answer shaped like a chat completion's logprobs: `tokens` entries of `top` alternatives."""
    content = [
        {
            "token": f"t{i} é",
            "logprob": -0.25 * (i % 7),
            "bytes": [116, 195, 169],
            "top_logprobs": [{"token": f"a{j}", "logprob": -1.5 * j, "bytes": [97]} for j in range(top)],
        }
        for i in range(tokens)
    ]
    return {
        "id": "x",
        "choices": [{"index": 0, "message": {"content": "…"}, "logprobs": {"content": content}}],
    }


def test_a_large_answer_is_the_same_json_as_starlettes():
    body = logprobs_answer(2_000, 20)
    large = asyncio.run(json_answer(lambda: body, LARGE_ANSWER_ENTRIES + 1, {"x-request-id": "r"}))
    assert large.body == JSONResponse(body).body
    assert large.headers["content-type"] == "application/json" and large.headers["x-request-id"] == "r"
    small = asyncio.run(json_answer(lambda: {"a": [1, 2.5, "é"]}, 3, {}))
    assert small.body == JSONResponse({"a": [1, 2.5, "é"]}).body


def worst_lag_while(make) -> float:
    """The worst lateness of a 5 ms ticker on the loop while `make()`'s answer is produced."""

    async def main() -> float:
        lags: list[float] = []

        async def ticker() -> None:
            while True:
                before = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - before - 0.005)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        await make()
        await asyncio.sleep(0.02)  # the ticker wakes (late, if the loop was held) and records it
        task.cancel()
        return max(lags)

    return asyncio.run(main())


def test_a_large_answer_does_not_hold_the_loop():
    """16 choices' worth of 1,000 tokens with 20 top logprobs each (~340k entries): built and encoded
    on the loop it holds it for well over 50 ms; `json_answer` keeps the loop on time."""
    body = logprobs_answer(16_000, 20)
    entries = 16_000 * 22

    async def on_the_loop():
        return JSONResponse(body)

    async def answered():
        return await json_answer(lambda: body, entries, {})

    held = worst_lag_while(on_the_loop)
    assert held > 0.05, f"the reference should hold the loop: {held * 1e3:.0f} ms"
    lags = sorted(worst_lag_while(answered) for _ in range(3))
    assert lags[0] < 0.05, (
        f"worst loop lag {[round(x * 1e3) for x in lags]} ms (on the loop: {held * 1e3:.0f} ms)"
    )
