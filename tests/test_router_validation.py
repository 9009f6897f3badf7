"""Validation table (pure): each invalid request names its field; defaults are applied."""

import json
import math

import pytest

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.errors import ValidationError
from router.validation import ModelSpec, fit_to_context, validate

MODEL = ModelSpec("m", max_model_len=100, vocab_size=1000)
MODELS = {"m": MODEL}
LIMITS = Limits(
    default_max_tokens=16,
    max_tokens_limit=64,
    max_stop_strings=2,
    max_stop_string_len=8,
    max_stop_token_ids=2,
    max_chat_messages=3,
    max_prompt_chars=50,
)


def req(**kw) -> pb.GenerateRequest:
    kw.setdefault("prompt", "hi")
    return pb.GenerateRequest(**kw)


INVALID = [
    ("no input", pb.GenerateRequest(), "input"),
    ("empty prompt", req(prompt=""), "prompt"),
    ("huge prompt", req(prompt="x" * 51), "prompt"),
    ("empty chat", pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    (
        "bad role",
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")])),
        "chat.messages[0].role",
    ),
    (
        "too many messages",
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")] * 4)),
        "chat.messages",
    ),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    ("token id out of vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 1000])), "token_ids.ids"),
    ("unknown model", req(model="gpt-9"), "model"),
    ("negative temperature", req(sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature"),
    ("nan temperature", req(sampling=pb.SamplingParams(temperature=math.nan)), "sampling.temperature"),
    ("top_p zero", req(sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
    ("top_p above one", req(sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    ("top_k above vocab", req(sampling=pb.SamplingParams(top_k=1001)), "sampling.top_k"),
    ("logprobs 2", req(sampling=pb.SamplingParams(logprobs=2)), "sampling.logprobs"),
    ("max_tokens 0", req(stopping=pb.StoppingCriteria(max_tokens=0)), "stopping.max_tokens"),
    ("max_tokens over limit", req(stopping=pb.StoppingCriteria(max_tokens=65)), "stopping.max_tokens"),
    ("too many stops", req(stopping=pb.StoppingCriteria(stop=["a", "b", "c"])), "stopping.stop"),
    ("empty stop", req(stopping=pb.StoppingCriteria(stop=[""])), "stopping.stop[0]"),
    ("long stop", req(stopping=pb.StoppingCriteria(stop=["ok", "x" * 9])), "stopping.stop[1]"),
    (
        "stop id out of vocab",
        req(stopping=pb.StoppingCriteria(stop_token_ids=[5000])),
        "stopping.stop_token_ids",
    ),
    (
        "too many stop ids",
        req(stopping=pb.StoppingCriteria(stop_token_ids=[1, 2, 3])),
        "stopping.stop_token_ids",
    ),
    (
        "top_logprobs 21",
        req(sampling=pb.SamplingParams(logprobs=1, top_logprobs=21)),
        "sampling.top_logprobs",
    ),
    ("top_logprobs alone", req(sampling=pb.SamplingParams(top_logprobs=2)), "sampling.top_logprobs"),
    ("prompt_logprobs 21", req(sampling=pb.SamplingParams(prompt_logprobs=21)), "sampling.prompt_logprobs"),
    ("min_p above one", req(sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p"),
    ("min_p nan", req(sampling=pb.SamplingParams(min_p=math.nan)), "sampling.min_p"),
    ("presence 3", req(sampling=pb.SamplingParams(presence_penalty=3)), "sampling.presence_penalty"),
    ("frequency -2.5", req(sampling=pb.SamplingParams(frequency_penalty=-2.5)), "sampling.frequency_penalty"),
    ("repetition 0", req(sampling=pb.SamplingParams(repetition_penalty=0)), "sampling.repetition_penalty"),
    (
        "repetition inf",
        req(sampling=pb.SamplingParams(repetition_penalty=math.inf)),
        "sampling.repetition_penalty",
    ),
    ("bias id out of vocab", req(sampling=pb.SamplingParams(logit_bias={1000: 1.0})), "sampling.logit_bias"),
    ("bias 101", req(sampling=pb.SamplingParams(logit_bias={5: 101.0})), "sampling.logit_bias"),
    ("bias nan", req(sampling=pb.SamplingParams(logit_bias={5: math.nan})), "sampling.logit_bias"),
    ("request id with space", req(request_id="a b"), "request_id"),
    ("request id too long", req(request_id="x" * 129), "request_id"),
    (
        "schema not JSON",
        req(response_format=pb.ResponseFormat(json_schema="{nope")),
        "response_format.json_schema",
    ),
    (
        "schema of an unknown type",
        req(response_format=pb.ResponseFormat(json_schema='{"type": "nope"}')),
        "response_format.json_schema",
    ),
    (
        "schema too large",
        req(response_format=pb.ResponseFormat(json_schema='{"enum": ["' + "x" * 70_000 + '"]}')),
        "response_format.json_schema",
    ),
    ("bad regex", req(response_format=pb.ResponseFormat(regex="(")), "response_format.regex"),
    (
        "json_object false",
        req(response_format=pb.ResponseFormat(json_object=False)),
        "response_format.json_object",
    ),
    (
        "format with ignore_eos",
        req(
            response_format=pb.ResponseFormat(json_object=True), stopping=pb.StoppingCriteria(ignore_eos=True)
        ),
        "response_format.json_object",
    ),
]


@pytest.mark.parametrize("case, message, field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_requests_name_their_field(case, message, field):
    with pytest.raises(ValidationError) as info:
        validate(message, LIMITS, MODELS)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_defaults_applied():
    v = validate(req(), LIMITS, MODELS)
    assert (v.temperature, v.top_p, v.top_k, v.seed, v.logprobs, v.max_tokens) == (
        1.0,
        1.0,
        0,
        None,
        False,
        None,
    )
    assert v.model is MODEL and len(v.request_id) == 32


def test_explicit_values_kept():
    v = validate(
        req(
            request_id="r-1",
            model="m",
            priority=3,
            sampling=pb.SamplingParams(temperature=0.0, top_p=0.5, top_k=7, seed=42, logprobs=1),
            stopping=pb.StoppingCriteria(max_tokens=9, stop=["\n"], stop_token_ids=[2], ignore_eos=True),
        ),
        LIMITS,
        MODELS,
    )
    assert (v.request_id, v.priority, v.temperature, v.top_p, v.top_k, v.seed, v.logprobs) == (
        "r-1",
        3,
        0.0,
        0.5,
        7,
        42,
        True,
    )
    assert (v.max_tokens, v.stop, v.stop_token_ids, v.ignore_eos) == (9, ("\n",), (2,), True)


def test_model_required_when_several_served():
    two = {"a": ModelSpec("a", 10, 10), "b": ModelSpec("b", 10, 10)}
    with pytest.raises(ValidationError, match="^model: required"):
        validate(req(), LIMITS, two)
    assert validate(req(model="b"), LIMITS, two).model.name == "b"


def test_fit_to_context():
    v = validate(req(), LIMITS, MODELS)
    assert fit_to_context(v, 10, LIMITS) == 16  # server default
    assert fit_to_context(v, 90, LIMITS) == 10  # default shrinks to the room left
    with pytest.raises(ValidationError, match="^prompt: This model's maximum context length is 100 tokens"):
        fit_to_context(v, 100, LIMITS)
    explicit = validate(req(stopping=pb.StoppingCriteria(max_tokens=20)), LIMITS, MODELS)
    assert fit_to_context(explicit, 80, LIMITS) == 20
    with pytest.raises(
        ValidationError, match="^stopping.max_tokens: .* you requested 101 tokens \\(81 in the prompt"
    ):
        fit_to_context(explicit, 81, LIMITS)
    chat = validate(
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")])), LIMITS, MODELS
    )
    with pytest.raises(ValidationError, match="^chat.messages: "):
        fit_to_context(chat, 0, LIMITS)


def test_scored_prompt_reply_must_fit_a_message():
    big = {"big": ModelSpec("big", max_model_len=10**6, vocab_size=1000)}
    scored = validate(req(sampling=pb.SamplingParams(prompt_logprobs=20)), LIMITS, big)
    assert fit_to_context(scored, 40_000, LIMITS) == 16  # ~6.5 MiB of reply
    with pytest.raises(ValidationError, match="^sampling.prompt_logprobs: scoring 60000 prompt tokens"):
        fit_to_context(scored, 60_000, LIMITS)
    one = validate(req(sampling=pb.SamplingParams(prompt_logprobs=1)), LIMITS, big)
    assert fit_to_context(one, 400_000, LIMITS) == 16  # one top token: 18 bytes per prompt token


def test_response_formats_become_grammars():
    assert validate(req(), LIMITS, MODELS).grammar == ""
    grammars = {
        validate(req(response_format=fmt), LIMITS, MODELS).grammar
        for fmt in (
            pb.ResponseFormat(json_object=True),
            pb.ResponseFormat(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
            pb.ResponseFormat(regex="[0-9]+"),
        )
    }
    assert len(grammars) == 3 and all(json.loads(g) for g in grammars)  # llguidance's JSON form


def test_new_sampling_params_kept():
    sampling = pb.SamplingParams(
        logprobs=1,
        top_logprobs=3,
        min_p=0.25,
        presence_penalty=-1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias={9: -100.0, 2: 4.5},
        prompt_logprobs=0,
    )
    v = validate(req(sampling=sampling), LIMITS, MODELS)
    assert v.prompt_logprobs == 0  # set (0: each prompt token's own logprob only)
    assert (v.top_logprobs, v.min_p, v.presence_penalty, v.frequency_penalty, v.repetition_penalty) == (
        3,
        0.25,
        -1.5,
        0.5,
        1.25,
    )
    assert v.logit_bias == ((2, 4.5), (9, -100.0))
    d = validate(req(), LIMITS, MODELS)
    assert d.prompt_logprobs is None
    assert (d.top_logprobs, d.min_p, d.presence_penalty, d.repetition_penalty, d.logit_bias) == (
        0,
        0,
        0,
        1,
        (),
    )
