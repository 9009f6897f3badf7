"""OpenAI / vLLM compatibility of /v1/chat/completions and /v1/completions found by review
(2026-12-04), unit level, no model needed: an unknown model is 404 model_not_found; vLLM's
chat-template controls are refused, not dropped; any int64 seed is accepted; an answer without
tokens has logprobs {"content": []}."""

from __future__ import annotations

import pytest

from protos.llm.v1 import generation_pb2 as pb
from router.errors import ValidationError
from router.openai.app import api_error
from router.openai.requests import ApiError, parse
from router.openai.responses import Responder

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_an_unknown_model_is_404_model_not_found_as_openai_and_vllm_answer():
    """OpenAI answers an unknown model with 404 {"code": "model_not_found"} (the SDK raises
    NotFoundError), vLLM with 404 NotFoundError, and this server's own GET /v1/models/{id} with 404;
    the generation endpoints answer 400 (BadRequestError)."""
    parsed = parse({**CHAT, "model": "no-such-model"}, chat=True, request_id="r")
    err = api_error(ValidationError("model", "unknown model 'no-such-model'; served: ['m']"), parsed)
    assert err.status == 404
    assert err.body()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "extra",
    [
        {"continue_final_message": True, "add_generation_prompt": False},  # vLLM's assistant prefill
        {"add_generation_prompt": False},  # refused by this server's own /tokenize
        {"chat_template_kwargs": {"enable_thinking": False}},  # vLLM: Qwen3 without thinking
    ],
)
def test_chat_template_controls_are_not_silently_ignored(extra):
    """vLLM's chat-template parameters change the prompt; this server dropped them without a word
    (the final assistant message then got a new assistant turn after it, instead of being
    continued). Refused with a 400 naming the parameter, as /tokenize refuses add_generation_prompt."""
    body = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "The answer is"}]}
    with pytest.raises(ApiError) as info:
        parse({**body, **extra}, chat=True, request_id="r")
    assert info.value.status == 400 and info.value.param in extra


def test_a_negative_seed_is_accepted_as_vllm_and_openai_accept_it():
    """vLLM: `seed: int | None = Field(None, ge=_LONG_INFO.min, le=_LONG_INFO.max)` (any int64);
    OpenAI's seed is any integer. Carried as the uint64 of its bits: -1 and 2**64 - 1 are the same
    seed, so a request stays reproducible."""
    parsed = parse({**CHAT, "seed": -1}, chat=True, request_id="r")
    assert parsed.request.sampling.seed == 2**64 - 1
    assert parse({**CHAT, "seed": 2**64 - 1}, chat=True, request_id="r").request.sampling.seed == 2**64 - 1


def test_chat_logprobs_of_an_empty_answer_are_an_empty_content_list_not_null():
    """With logprobs: true OpenAI (and vLLM) always answer `logprobs: {"content": [...]}`; a choice
    with no tokens got null, so `choice.logprobs.content` raised AttributeError in clients."""
    parsed = parse({**CHAT, "logprobs": True}, chat=True, request_id="r")
    done = pb.Finished(reason=pb.FINISH_REASON_STOP)
    answer = Responder(parsed, "m", str).complete([([], done)])
    assert answer["choices"][0]["logprobs"] == {"content": []}
