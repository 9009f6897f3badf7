"""Whole JSON answers of the HTTP front (router/openai/http.py `json_answer`): the same bytes as
Starlette's JSONResponse, and a large one built and encoded without holding the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
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
    """8 choices' worth of 1,000 tokens with 20 top logprobs each (~180k entries): built and encoded
    on the loop it holds it for well over 50 ms; `json_answer` keeps the loop on time."""
    body = logprobs_answer(8_000, 20)
    entries = 8_000 * 22

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


def test_a_tenants_unread_answers_and_open_streams_are_capped():
    """`Outbound`: an answer's bytes count against its tenant until the server took them (a send
    that blocks, as to a client that reads nothing); past the cap the tenant's next request gets
    429, others' do not; streams likewise, and every release happens once."""
    from router.openai.http import Outbound, OwedJSON, json_answer
    from router.openai.requests import ApiError

    outbound = Outbound(max_streams=1, max_unsent_bytes=1000)

    async def main() -> None:
        response = await json_answer(lambda: {"text": "x" * 2000}, 1, {}, lambda n: outbound.owe("a", n))
        assert isinstance(response, OwedJSON) and outbound.unsent["a"] == len(response.body)
        taken = asyncio.Event()

        async def send(message) -> None:
            if message["type"] == "http.response.body":
                await taken.wait()  # a client that reads nothing, until it does

        async def receive():
            return {"type": "http.disconnect"}

        sending = asyncio.ensure_future(response({"type": "http"}, receive, send))
        await asyncio.sleep(0)
        with pytest.raises(
            ApiError,
            match=r"tenant a: 2,0\d\d bytes of answers not yet read by its clients \(at most 1,000\)",
        ) as refused:
            outbound.check("a")
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        outbound.check("b")  # another tenant is not held back
        taken.set()
        await sending
        assert "a" not in outbound.unsent
        outbound.check("a")

    asyncio.run(main())
    end = outbound.open_stream("a")
    with pytest.raises(ApiError, match="tenant a: 1 streams already open"):
        outbound.open_stream("a")
    outbound.open_stream("b")()
    end()
    end()  # once only
    assert outbound.streams == {} or outbound.streams["a"] == 0
    outbound.open_stream("a")()


def test_an_embeddings_answer_gives_the_loop_back_between_vectors():
    """router/openai/embeddings.py `answer`: 2,048 vectors of 576 floats (~24 MB of JSON), read as
    the server reads it (a send that does not wait), keep a ticker on time; the JSON is whole."""
    import json
    import random

    from router.openai import embeddings

    rng = random.Random(0)
    vectors = [[rng.uniform(-1, 1) for _ in range(576)] for _ in range(2048)]
    parsed = embeddings.EmbeddingRequest(model="m", requests=[], base64=False, normalize=False)
    body = []

    async def read():
        async for piece in embeddings.answer(parsed, "m", vectors, 4096):
            body.append(piece)

    lags = sorted(worst_lag_while(read) for _ in range(3))
    assert lags[0] < 0.05, f"worst loop lag {[round(x * 1e3) for x in lags]} ms"
    answer = json.loads(b"".join(body[: len(body) // 3]))  # (3 runs appended) the first whole answer
    assert len(answer["data"]) == 2048 and answer["data"][5]["embedding"] == vectors[5]
