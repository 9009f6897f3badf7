"""OpenAI request JSON -> `llm.v1.GenerateRequest` plus the response options (stream, usage,
logprobs), checked field by field.

Contract
- input: the decoded JSON body of POST /v1/chat/completions (`chat=True`) or /v1/completions, and
  the request id the front chose (the client's X-Request-Id, or a new one).
- output: `Parsed`: one protobuf request per choice (`n` per prompt; a completions batch of
  prompts gives prompt-major choices, index = prompt * n + j) and how to shape the answer. With
  several choices each request id gets "-<index>" and a `seed` becomes seed + j for the j-th
  choice of a prompt (distinct, reproducible samples). The service then validates each protobuf
  exactly as for gRPC; `param_of` maps its field names back to the OpenAI parameter.
  Completions' `echo` puts each prompt in front of its choice; with `logprobs` N the prompt's
  tokens are scored too (`sampling.prompt_logprobs` N: lm-evaluation-harness's loglikelihood
  requests send echo, logprobs 1 and max_tokens 1), and `max_tokens` 0 (echo only, what other
  scorers send) asks the worker for one token that the answer leaves out (`Parsed.echo_only`).
  Chat `tools` / `tool_choice` (router/openai/tools.py) put the tools on `chat.tools`, a schema on
  `response_format` for "required" or a named function, and `Parsed.tools` says how to read the
  answer; messages carry an assistant's `tool_calls` and a tool result's `tool_call_id`.
- state: none (pure).
- failure modes: `ApiError(400, message, param)` naming the parameter for a wrong JSON type, a value
  the protobuf cannot carry (a seed outside int64/uint64), more than MAX_CHOICES choices in all, or a feature
  this server does not have (suffix, best_of > 1, the deprecated functions); a `response_format`
  other than text, json_object or json_schema; tools that router/openai/tools.py refuses.
  Parameters it does not know are ignored, as OpenAI's own server ignores none but clients send
  vendor extensions; docs/openai.md lists what is honoured.
- proven by: tests/test_openai_requests.py (table), tests/test_openai_e2e.py (through the SDK).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.openai.formats import FormatError, parse_format
from router.openai.tools import ToolMode, ToolsError, parse_tools
from router.validation import count_bounds

INT32_MAX, UINT32_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**64 - 1  # what the protobuf fields hold
MAX_COMPLETIONS_LOGPROBS = 20  # /v1/completions `logprobs` is the number of top tokens (OpenAI: 5)
# Choices per HTTP request (n x prompts): each is a generation of its own (admission counts each),
# and the bound keeps one request's pre-admission work (parsing, tokenizing) small.
MAX_CHOICES = 16
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system messages


class ApiError(Exception):
    """An HTTP error with an OpenAI error object: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # raised in a body-decoder process (router/openai/http.py), re-raised here
        return (ApiError, (self.status, self.message, self.param, self.type, self.code, self.headers))


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice of a request: what sets it apart from the other choices of its prompt."""

    index: int  # in the answer: prompt * n + j
    prompt: int  # which of `Parsed.prompt_requests` it generates from
    request_id: str  # the answer's id, plus "-<index>" when there are several choices
    seed_offset: int  # j: a seeded request's j-th choice samples with seed + j (mod 2**64)


@dataclass
class Parsed:
    request: pb.GenerateRequest  # the first prompt's (the answer's id and model come from it)
    chat: bool
    # one protobuf per prompt (chat: one), shared by that prompt's n choices: never n copies
    prompt_requests: list[pb.GenerateRequest] = field(default_factory=list)
    choices: list[ChoiceSpec] = field(default_factory=list)  # in index order
    n: int = 1  # choices per prompt
    request_id: str = ""  # the answer's (each choice's request adds "-<index>" when there are several)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: each choice's prompt in front of its text (and logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the worker's one token is left out
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens_param: str = "max_tokens"
    params: dict[str, str] = field(default_factory=dict)  # protobuf field -> OpenAI parameter
    tools: ToolMode | None = None  # chat with tools (tool_choice not none): how to read the answer

    def request_of(self, index: int) -> pb.GenerateRequest:
        """The protobuf choice `index` generates from (its prompt's; ids and seeds: `choices`)."""
        return self.prompt_requests[self.choices[index].prompt]


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number
        raise _bad(name, f"must be {what}, got {value!r}")
    if not isinstance(value, kinds):
        raise _bad(name, f"must be {what}, got {type(value).__name__}")
    return value


def _number(body: dict, name: str) -> float | None:
    value = _get(body, name, (int, float), "a number")
    if isinstance(value, int) and abs(value) > 2**1023:  # JSON integers have no bound; floats do
        raise _bad(name, "must be a finite number, got an integer beyond the float range")
    if value is not None and not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {value}")
    return None if value is None else float(value)


def _int(body: dict, name: str, low: int | None = None, high: int = INT32_MAX) -> int | None:
    value = _get(body, name, (int,), "an integer")
    if value is not None and low is not None and value < low:
        raise _bad(name, f"must be >= {low}, got {value}")
    if value is not None and value > high:
        raise _bad(name, f"must be <= {high}, got {value}")
    return value


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in value
    )


def _text_of(content, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(param, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{i}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(calls: object, where: str) -> list[pb.ToolCall]:
    """An assistant message's `tool_calls` (arguments: JSON text, or an object some clients send)."""
    if not isinstance(calls, list):
        raise _bad(where, "must be a list of {id, type: 'function', function: {name, arguments}}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{j}].function", "must be an object with a string name")
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise _bad(f"{where}[{j}].function.arguments", "must be a string of JSON")
        call_id = call.get("id") if isinstance(call.get("id"), str) else ""
        out.append(pb.ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return out


def _messages(body: dict) -> pb.Chat:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "required: a list of {role, content} objects")
    chat = pb.Chat()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string role")
        role = ROLE_ALIASES.get(m["role"], m["role"])
        one = chat.messages.add(role=role, content=_text_of(m.get("content"), f"messages[{i}].content"))
        if m.get("tool_calls"):
            one.tool_calls.extend(_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls"))
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise _bad(f"messages[{i}].tool_call_id", f"must be a string, got {type(call_id).__name__}")
            one.tool_call_id = call_id
    return chat


def _prompts(body: dict) -> list[str | list[int]]:
    """The completions prompt(s): a string, a list of token ids, or a batch (list) of either."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    for i, one in enumerate(prompts):
        where = f"prompt: batch item {i}:" if batch else "prompt:"
        if isinstance(one, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in one):
            if not _token_ids(one):
                raise ApiError(400, f"{where} token ids must be in [0, {UINT32_MAX}]", param="prompt")
        elif not isinstance(one, str):
            raise ApiError(400, f"{where} required: a string or a list of token ids", param="prompt")
    return prompts


def _set_prompt(req: pb.GenerateRequest, prompt: str | list[int]) -> None:
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.token_ids.ids[:] = prompt


def _copy(req: pb.GenerateRequest) -> pb.GenerateRequest:
    one = pb.GenerateRequest()
    one.CopyFrom(req)
    return one


def _unsupported(body: dict, chat: bool) -> None:
    for name in ("functions", "function_call"):  # the deprecated form of tools
        if body.get(name):
            raise _bad(name, "deprecated by OpenAI and not supported: send tools and tool_choice")
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name):
                raise _bad(name, "tool calling is for /v1/chat/completions")
        if _get(body, "suffix", (str,), "a string"):
            raise _bad("suffix", "suffix is not supported")
        if _int(body, "best_of", 1) not in (None, 1):
            raise _bad("best_of", "only best_of = 1 is supported")
    # vLLM's chat-template controls change the prompt: refused, never silently dropped
    if chat and body.get("continue_final_message"):
        raise _bad("continue_final_message", "not supported (the prompt ends with a new assistant turn)")
    if chat and body.get("add_generation_prompt", True) is not True:
        raise _bad(
            "add_generation_prompt", "only true is supported (the prompt ends with the assistant's turn)"
        )
    if chat and body.get("chat_template_kwargs"):
        raise _bad("chat_template_kwargs", "not supported: the model's template renders with its defaults")


def _logprobs(body: dict, chat: bool, s: pb.SamplingParams, out: Parsed) -> None:
    if chat:
        out.logprobs = bool(_get(body, "logprobs", (bool,), "a boolean"))
        top = _int(body, "top_logprobs", 0) or 0
        if top and not out.logprobs:
            raise _bad("top_logprobs", "needs logprobs: true")
        out.params["sampling.top_logprobs"] = "top_logprobs"
    else:
        top = _int(body, "logprobs", 0)
        if top is not None and top > MAX_COMPLETIONS_LOGPROBS:
            raise _bad("logprobs", f"must be 0 to {MAX_COMPLETIONS_LOGPROBS}, got {top}")
        out.logprobs, top = top is not None, top or 0
        out.params["sampling.top_logprobs"] = "logprobs"
        if out.echo and out.logprobs:  # the prompt's tokens are scored as well
            s.prompt_logprobs = top
            out.params["sampling.prompt_logprobs"] = "logprobs"
    out.top_logprobs = top
    s.logprobs = int(out.logprobs)
    s.top_logprobs = top


def _sampling(body: dict, s: pb.SamplingParams) -> None:
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            setattr(s, name, value)
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(s, name, _number(body, name) or 0.0)
    s.top_k = max(0, _int(body, "top_k", -1) or 0)  # -1 is vLLM's "off"
    seed = _int(body, "seed", -(2**63), UINT64_MAX)  # any int64 (vLLM), as the uint64 of its bits
    if seed is not None:
        s.seed = seed % 2**64
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to biases") or {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) or int(key) > UINT32_MAX:
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad("logit_bias", f"the bias of token {key} must be a number, got {value!r}")
        s.logit_bias[int(key)] = float(value)


def _stopping(body: dict, chat: bool, st: pb.StoppingCriteria, out: Parsed) -> None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = _int(body, name)
        if value is not None:
            if value == 0 and out.echo:  # the prompt only: one token is generated and left out
                value, out.echo_only = 1, True
            if value < 1:
                raise _bad(name, f"must be >= 1 (0 only with echo), got {value}")
            st.max_tokens, out.max_tokens_param = value, name
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise _bad("stop", "must be a string or a list of strings")
    st.stop.extend(stop or [])
    ids = body.get("stop_token_ids") or []
    if not _token_ids(ids):
        raise _bad("stop_token_ids", "must be a list of token ids")
    st.stop_token_ids.extend(ids)
    st.ignore_eos = bool(_get(body, "ignore_eos", (bool,), "a boolean"))


def parse(body: object, chat: bool, request_id: str, limits: Limits = Limits()) -> Parsed:
    """`limits`: the router's; their counts are checked on the JSON, before any protobuf is built
    (a body of a million logit_bias entries or stop strings is refused in microseconds)."""
    try:
        _bounded(body, chat, limits)
        return _parse(body, chat, request_id)
    except (ValueError, TypeError) as exc:  # a value the protobuf refuses that no check above caught
        raise ApiError(400, f"request: {exc}") from None
    except RecursionError:  # a value nested nearly as deep as the body parser allows
        raise ApiError(400, "request: nested too deeply") from None


def _bounded(body: object, chat: bool, limits: Limits) -> None:
    """The counts validation would refuse (router/validation.py `count_bounds`), on the decoded
    JSON: O(1) each, before the work they would multiply."""
    if not isinstance(body, dict):
        return  # _parse names the problem
    for pb_field, name, limit, what in count_bounds(limits):
        if pb_field.startswith("chat.") and not chat or name == "prompt" and chat:
            continue
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise _bad(name, f"at most {limit} {what}, got {len(value)}")


def _parse(body: object, chat: bool, request_id: str) -> Parsed:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _unsupported(body, chat)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    prompts = [None] if chat else _prompts(body)
    if n * len(prompts) > MAX_CHOICES:
        raise _bad("n", f"n x prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}")
    req = pb.GenerateRequest(request_id=request_id, model=_get(body, "model", (str,), "a string") or "")
    out = Parsed(request=req, chat=chat, n=n, request_id=request_id)
    out.echo = not chat and bool(_get(body, "echo", (bool,), "a boolean"))
    if chat:
        req.chat.CopyFrom(_messages(body))
    out.stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object")
    if options is not None:
        if not out.stream:
            raise _bad("stream_options", "only allowed with stream: true")
        out.include_usage = bool(_get(options, "include_usage", (bool,), "a boolean"))
    _sampling(body, req.sampling)
    _logprobs(body, chat, req.sampling, out)
    _stopping(body, chat, req.stopping, out)
    req.priority = _int(body, "priority", -INT32_MAX - 1) or 0
    try:
        parse_format(body, req, out.params)
    except FormatError as exc:
        raise _bad(exc.param, exc.problem) from None
    if chat:
        try:
            out.tools = parse_tools(body, req.chat, req)
        except ToolsError as exc:
            param = exc.param
            if param == "response_format":  # the format may have come by another server's name
                param = out.params.get(f"response_format.{req.response_format.WhichOneof('kind')}", param)
            raise _bad(param, exc.problem) from None
        if out.tools and out.tools.choice != "auto":  # the schema (and its errors) come from tools
            out.params["response_format.json_schema"] = "tools"
    several = len(prompts) * n > 1
    # each prompt of a batch has its own protobuf (copied before any prompt is set)
    out.prompt_requests = [req] + [_copy(req) for _ in prompts[1:]]
    for i, prompt in enumerate(prompts):  # the n choices of a prompt share its protobuf
        if prompt is not None:
            _set_prompt(out.prompt_requests[i], prompt)
        for j in range(n):
            index = len(out.choices)
            rid = f"{request_id}-{index}" if several else request_id
            out.choices.append(ChoiceSpec(index, i, rid, j))
    out.request = out.prompt_requests[0]
    return out


FIELD_PARAMS = {
    "chat.messages": "messages",
    "prompt": "prompt",
    "token_ids.ids": "prompt",
    "token_ids": "tokens",  # /detokenize
    "stopping.stop": "stop",
    "stopping.stop_token_ids": "stop_token_ids",
    "request_id": "X-Request-Id",
}


def param_of(field_name: str, parsed: Parsed | None) -> str:
    """The OpenAI parameter behind a validation error's protobuf field name."""
    if parsed is not None and field_name in parsed.params:
        return parsed.params[field_name]
    if field_name == "stopping.max_tokens":
        return parsed.max_tokens_param if parsed else "max_tokens"
    if field_name.startswith("chat.tools["):  # chat.tools[i].name -> tools[i].function.name
        return re.sub(r"^chat\.(tools\[\d+\])\.", r"\1.function.", field_name)
    if field_name.startswith("chat."):  # ... tool_calls[j].arguments -> tool_calls[j].function.arguments
        return re.sub(r"(tool_calls\[\d+\])\.", r"\1.function.", field_name.removeprefix("chat."))
    if field_name.startswith("stopping.stop["):
        return field_name.removeprefix("stopping.")
    if field_name.startswith("sampling."):
        return field_name.removeprefix("sampling.")
    if field_name.startswith("response_format"):
        return "response_format"
    return FIELD_PARAMS.get(field_name, field_name)
