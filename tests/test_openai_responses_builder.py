"""router/openai/responses_api.py's ResponseBuilder in process: the streamed and the whole answer
give each output item the same status. The finish (max tokens: "incomplete") is the last item's;
an item another one followed was completed (the whole answer marked them all "incomplete" while
the stream had closed them "completed")."""

from __future__ import annotations

import asyncio
import json

import pytest

from protos.llm.v1 import generation_pb2 as pb
from router.openai.requests import Parsed
from router.openai.responses_api import ResponseBuilder
from router.openai.tools import ToolMode

CALL = '{"name": "f", "arguments": {"x": 1}}'
CASES = {
    "auto": (ToolMode("auto", ("f",)), ["Sure. ", "<tool_call>" + CALL + "</tool_call>", " and more"]),
    "required": (ToolMode("required", ("f",)), ["[" + CALL + ",", CALL + ",", '{"name": "f", "argu']),
    "text": (None, ["Just ", "text"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("reason", [pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP])
def test_streamed_and_whole_items_have_the_same_status(case, reason):
    mode, pieces = CASES[case]
    parsed = Parsed(request=pb.GenerateRequest(), chat=True, request_id="r", tools=mode)
    chunks = [pb.TokenChunk(token_ids=[1], text=p) for p in pieces]
    done = pb.Finished(reason=reason, usage=pb.Usage(prompt_tokens=3, completion_tokens=len(pieces)))
    whole = ResponseBuilder(parsed, "m", None).whole(chunks, done)

    async def events():
        for chunk in chunks:
            yield 0, chunk
        yield 0, done

    async def streamed() -> dict:
        last = None
        async for data in ResponseBuilder(parsed, "m", None).stream(events(), lambda exc: exc):
            last = json.loads(data.decode().split("data: ", 1)[1])
        return last["response"]

    statuses = [(o["type"], o["status"]) for o in whole["output"]]
    assert statuses == [(o["type"], o["status"]) for o in asyncio.run(streamed())["output"]]
    finish = "incomplete" if reason == pb.FINISH_REASON_LENGTH else "completed"
    assert [s for _, s in statuses] == ["completed"] * (len(statuses) - 1) + [finish], statuses
    assert len(statuses) == {"auto": 2, "required": 2, "text": 1}[case]
