"""Request validation: protobuf `GenerateRequest` -> `ValidRequest` (plain dataclass), or
`ValidationError` whose message starts with the offending field's name.

Contract
- input: a `GenerateRequest`, the router's `Limits`, and the served models (name -> `ModelSpec`).
- output: `ValidRequest` with defaults applied; after tokenization `fit_to_context` checks the
  prompt length against the model's context and resolves `max_tokens` (bounded by the context,
  and by `Limits.max_tokens_limit` only where an operator sets one).
- state: none (pure; no grpc, no I/O).
- failure modes: `ValidationError` (INVALID_ARGUMENT) naming the field, e.g. `sampling.top_p: ...`;
  a prompt, or prompt + max_tokens, over the context is its subclass `ContextLengthExceeded`
  (OpenAI's wording and, over HTTP, `code: "context_length_exceeded"`: router/errors.py).
- proven by: tests/test_router_validation.py (table), tests/test_grpc_e2e.py (invalid-request table)
  (end to end), tests/test_openai_limits_e2e.py (the context errors, the limits' defaults).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from common.structured import MAX_GRAMMAR_BYTES, after_thinking, compile_executor, grammar_of
from protos.llm.v1 import generation_pb2 as pb
from router.chat_validation import CHAT_ROLES, MAX_TOOLS, validate_chat  # noqa: F401 - CHAT_ROLES: the fuzz tests' roles
from router.config import Limits
from router.errors import ValidationError, context_exceeded

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit
# A scored prompt's reply (TokenChunk.prompt_logprobs) must fit a gRPC message on both hops (16 MiB
# by default): bytes per prompt token for N top tokens, measured 17 (N = 1) and 151 (N = 20).
PROMPT_LOGPROBS_MAX_BYTES = 8 * 2**20


def prompt_logprobs_bytes(num_prompt_tokens: int, top: int) -> int:
    return num_prompt_tokens * (10 + 8 * top)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_model_len: int
    vocab_size: int
    base: str = ""  # a LoRA adapter's base model (its workers' WorkerInfo.model); "" = a base model


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    model: ModelSpec
    prompt: str | None = None  # exactly one of prompt / chat / token ids
    chat: tuple[dict, ...] | None = None  # message dicts (router/chat_validation.py)
    tools: tuple[dict, ...] = ()  # chat only: the tools the template shows the model
    chat_chars: int = 0  # chat only: the characters it renders from (contents, calls, tools)
    prompt_token_ids: tuple[int, ...] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted by token id
    max_tokens: int | None = None  # None = server default, fitted to the context
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    grammar: str = ""  # structured output: the llguidance grammar the worker runs ("" = free text)
    # the format it compiles from, (kind, text) (router/grammar_compile.py's key); with
    # validate(compile_grammar=False) `grammar` stays "" until `compile_response_format`
    grammar_source: tuple[str, str] | None = None
    prompt_logprobs: int | None = None  # None = off; N: the prompt's logprobs and N top tokens each
    pooling: int = 0  # pb.Pooling: 0 = off; an embedding of the prompt, with one token


def count_bounds(limits: Limits) -> tuple[tuple[str, str, int, str], ...]:
    """The repeated fields whose count validation bounds, as (protobuf field, OpenAI parameter,
    bound, what they are): the fronts check these counts before they build or parse a protobuf
    (router/openai/requests.py on the JSON, router/decode_pool.py on a large message's bytes).
    `prompt` is the completions parameter: a batch of prompts, or token ids."""
    return (
        ("sampling.logit_bias", "logit_bias", MAX_LOGIT_BIAS, "entries"),
        ("stopping.stop", "stop", limits.max_stop_strings, "stop strings"),
        ("stopping.stop_token_ids", "stop_token_ids", limits.max_stop_token_ids, "stop token ids"),
        ("chat.messages", "messages", limits.max_chat_messages, "messages"),
        ("chat.tools", "tools", MAX_TOOLS, "tools"),
        ("token_ids.ids", "prompt", limits.max_prompt_chars, "prompt items"),
    )


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValidationError(field, problem)


def _resolve_model(name: str, models: Mapping[str, ModelSpec]) -> ModelSpec:
    if name:
        _check(name in models, "model", f"unknown model {name!r}; served: {sorted(models)}")
        return models[name]
    bases = [spec for spec in models.values() if not spec.base]  # a LoRA adapter is named, never implied
    _check(len(bases) == 1, "model", f"required when several models are served: {sorted(models)}")
    return bases[0]


def checked_request_id(rid: str, limits: Limits) -> str:
    """`rid`, checked (a new one when empty)."""
    if not rid:
        return uuid.uuid4().hex
    _check(
        len(rid) <= limits.max_request_id_len,
        "request_id",
        f"longer than {limits.max_request_id_len} characters",
    )
    _check(
        rid.isascii() and rid.isprintable() and " " not in rid,
        "request_id",
        "must be printable ASCII without spaces",
    )
    return rid


def _input(req: pb.GenerateRequest, model: ModelSpec, limits: Limits) -> dict:
    kind = req.WhichOneof("input")
    _check(kind is not None, "input", "one of prompt, chat or token_ids is required")
    if kind == "prompt":
        _check(req.prompt != "", "prompt", "must not be empty")
        _check(
            len(req.prompt) <= limits.max_prompt_chars,
            "prompt",
            f"longer than {limits.max_prompt_chars} characters",
        )
        return {"prompt": req.prompt}
    if kind == "chat":
        return validate_chat(req.chat, limits)
    # the length first (O(1)): checking each of millions of ids would stall the router's event loop
    if len(req.token_ids.ids) >= model.max_model_len:
        raise context_exceeded("token_ids.ids", model.max_model_len, len(req.token_ids.ids))
    ids = tuple(req.token_ids.ids)
    _check(len(ids) > 0, "token_ids.ids", "must not be empty")
    bad = next((t for t in ids if t >= model.vocab_size), None)
    _check(
        bad is None, "token_ids.ids", f"token id {bad} is outside the vocabulary (size {model.vocab_size})"
    )
    return {"prompt_token_ids": ids}


def _sampling(s: pb.SamplingParams, model: ModelSpec) -> dict:
    out: dict = {}
    if s.HasField("temperature"):
        t = s.temperature
        _check(math.isfinite(t) and t >= 0, "sampling.temperature", f"must be a finite number >= 0, got {t}")
        out["temperature"] = float(t)
    if s.HasField("top_p"):
        p = s.top_p
        _check(math.isfinite(p) and 0 < p <= 1, "sampling.top_p", f"must be in (0, 1], got {p}")
        out["top_p"] = float(p)
    _check(
        s.top_k <= model.vocab_size,
        "sampling.top_k",
        f"must be <= the vocabulary size {model.vocab_size} (0 = off), got {s.top_k}",
    )
    _check(s.logprobs <= 1, "sampling.logprobs", f"must be 0 or 1, got {s.logprobs}")
    out.update(top_k=s.top_k, logprobs=s.logprobs == 1)
    if s.HasField("seed"):
        out["seed"] = s.seed
    return out | _sampling_extras(s, model)


def _sampling_extras(s: pb.SamplingParams, model: ModelSpec) -> dict:
    """min_p, penalties, logit_bias, top_logprobs, prompt_logprobs (the sampler's own ranges)."""
    out: dict = {}
    _check(
        s.top_logprobs <= MAX_TOP_LOGPROBS,
        "sampling.top_logprobs",
        f"must be 0 to {MAX_TOP_LOGPROBS}, got {s.top_logprobs}",
    )
    _check(s.top_logprobs == 0 or s.logprobs == 1, "sampling.top_logprobs", "needs sampling.logprobs = 1")
    out["top_logprobs"] = s.top_logprobs
    if s.HasField("prompt_logprobs"):
        _check(
            s.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "sampling.prompt_logprobs",
            f"must be 0 to {MAX_TOP_LOGPROBS}, got {s.prompt_logprobs}",
        )
        out["prompt_logprobs"] = s.prompt_logprobs
    if s.pooling:
        _check(s.pooling in pb.Pooling.values(), "sampling.pooling", f"unknown value {s.pooling}")
        out["pooling"] = s.pooling
    if s.HasField("min_p"):
        _check(
            math.isfinite(s.min_p) and 0 <= s.min_p <= 1,
            "sampling.min_p",
            f"must be in [0, 1], got {s.min_p}",
        )
        out["min_p"] = float(s.min_p)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        _check(
            math.isfinite(value) and -2 <= value <= 2, f"sampling.{name}", f"must be in [-2, 2], got {value}"
        )
        out[name] = float(value)
    if s.HasField("repetition_penalty"):
        r = s.repetition_penalty
        _check(math.isfinite(r) and 0 < r <= 2, "sampling.repetition_penalty", f"must be in (0, 2], got {r}")
        out["repetition_penalty"] = float(r)
    bias = s.logit_bias
    _check(
        len(bias) <= MAX_LOGIT_BIAS,
        "sampling.logit_bias",
        f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
    )
    for token, value in sorted(bias.items()):
        _check(
            token < model.vocab_size,
            "sampling.logit_bias",
            f"token id {token} is outside the vocabulary (size {model.vocab_size})",
        )
        _check(
            math.isfinite(value) and -100 <= value <= 100,
            "sampling.logit_bias",
            f"bias of token {token} must be in [-100, 100], got {value}",
        )
    out["logit_bias"] = tuple(sorted((t, float(v)) for t, v in bias.items()))
    return out


def _stopping(s: pb.StoppingCriteria, model: ModelSpec, limits: Limits) -> dict:
    out: dict = {"ignore_eos": s.ignore_eos}
    if s.HasField("max_tokens"):
        _check(s.max_tokens >= 1, "stopping.max_tokens", "must be >= 1 (leave unset for the server default)")
        cap = limits.max_tokens_limit  # the operator's cap, if any; the context bounds it always
        _check(
            cap is None or s.max_tokens <= cap, "stopping.max_tokens", f"must be <= {cap}, got {s.max_tokens}"
        )
        if s.max_tokens >= model.max_model_len:  # no room for one prompt token: refused before tokenizing
            raise context_exceeded("stopping.max_tokens", model.max_model_len, max_tokens=s.max_tokens)
        out["max_tokens"] = s.max_tokens
    _check(
        len(s.stop) <= limits.max_stop_strings,
        "stopping.stop",
        f"at most {limits.max_stop_strings} stop strings, got {len(s.stop)}",
    )
    for i, text in enumerate(s.stop):
        _check(
            0 < len(text) <= limits.max_stop_string_len,
            f"stopping.stop[{i}]",
            f"must be 1 to {limits.max_stop_string_len} characters long",
        )
    out["stop"] = tuple(s.stop)
    _check(
        len(s.stop_token_ids) <= limits.max_stop_token_ids,
        "stopping.stop_token_ids",
        f"at most {limits.max_stop_token_ids} ids, got {len(s.stop_token_ids)}",
    )
    bad = next((t for t in s.stop_token_ids if t >= model.vocab_size), None)
    _check(
        bad is None,
        "stopping.stop_token_ids",
        f"token id {bad} is outside the vocabulary (size {model.vocab_size})",
    )
    out["stop_token_ids"] = tuple(s.stop_token_ids)
    return out


@functools.lru_cache(maxsize=64)
def _grammar(kind: str, value: str) -> str:
    """The llguidance grammar of one format, compiled in this process without a time bound
    (validate's default: tests, fuzzing); the router compiles through router/grammar_compile.py."""
    return grammar_of(kind, value)


def _response_format(req: pb.GenerateRequest, compile_grammar: bool) -> dict:
    """The format as `grammar_source` (bounded: common.structured.MAX_GRAMMAR_BYTES), and with
    `compile_grammar` its grammar, compiled here, so that a schema llguidance cannot run is a 400
    before admission, not a worker error."""
    kind = req.response_format.WhichOneof("kind")
    if kind is None:
        return {}
    field = f"response_format.{kind}"
    _check(not req.stopping.ignore_eos, field, "ends its output with EOS: not with stopping.ignore_eos")
    _check(kind != "json_object" or req.response_format.json_object, field, "must be true when set")
    value = getattr(req.response_format, kind) if kind != "json_object" else ""
    if kind == "choice":  # a hashable form for the cache; its size is bounded like a schema's
        value = json.dumps(list(value.options))
    _check(len(value) <= MAX_GRAMMAR_BYTES, field, f"{len(value)} bytes, more than {MAX_GRAMMAR_BYTES}")
    if not compile_grammar:
        return {"grammar_source": (kind, value)}
    try:
        return {"grammar": _grammar(kind, value), "grammar_source": (kind, value)}
    except ValueError as exc:
        raise ValidationError(field, str(exc)) from None


async def compile_response_format(req: ValidRequest, compiler, tenant: str) -> ValidRequest:
    """`req` with the grammar of its `grammar_source`, compiled by `compiler`
    (router.grammar_compile.GrammarCompiler: a budget, a cache, the tenant's share); a refusal is a
    ValidationError naming the format's field."""
    if req.grammar or req.grammar_source is None:
        return req
    kind, value = req.grammar_source
    try:
        grammar = await compiler.compile(("format", kind, value), tenant)
    except ValueError as exc:
        raise ValidationError(f"response_format.{kind}", str(exc)) from None
    return dataclasses.replace(req, grammar=grammar)


def validate(
    req: pb.GenerateRequest,
    limits: Limits,
    models: Mapping[str, ModelSpec],
    *,
    compile_grammar: bool = True,
) -> ValidRequest:
    """Everything that can be checked before tokenization. `compile_grammar=False` (the router)
    leaves the format's grammar to `compile_response_format`: no llguidance work here."""
    model = _resolve_model(req.model, models)
    _check(
        not req.sampling.pooling or req.stopping.max_tokens <= 1,
        "stopping.max_tokens",
        f"must be 1 (or unset) with sampling.pooling: an embedding comes with one token, "
        f"got {req.stopping.max_tokens}",
    )
    return ValidRequest(
        request_id=checked_request_id(req.request_id, limits),
        model=model,
        priority=req.priority,
        **_input(req, model, limits),
        **_sampling(req.sampling, model),
        **_stopping(req.stopping, model, limits),
        **_response_format(req, compile_grammar),
    )


def fit_to_context(req: ValidRequest, num_prompt_tokens: int, limits: Limits) -> int:
    """Checks the tokenized prompt against the model's context; returns the max_tokens to use."""
    context = req.model.max_model_len
    field = "token_ids.ids" if req.prompt_token_ids is not None else "chat.messages" if req.chat else "prompt"
    _check(num_prompt_tokens > 0, field, "tokenizes to zero tokens")
    if req.prompt_logprobs is not None:
        size = prompt_logprobs_bytes(num_prompt_tokens, req.prompt_logprobs)
        _check(
            size <= PROMPT_LOGPROBS_MAX_BYTES,
            "sampling.prompt_logprobs",
            f"scoring {num_prompt_tokens} prompt tokens with {req.prompt_logprobs} top tokens each makes a "
            f"reply of ~{size / 2**20:.1f} MiB, more than {PROMPT_LOGPROBS_MAX_BYTES // 2**20} MiB: ask for "
            "fewer top tokens or a shorter prompt",
        )
    if num_prompt_tokens >= context:
        raise context_exceeded(field, context, num_prompt_tokens)
    room = context - num_prompt_tokens
    if req.pooling:
        return 1
    if req.max_tokens is None:
        return min(limits.default_max_tokens, room)
    if req.max_tokens > room:
        noun = "messages" if req.chat else "prompt"
        raise context_exceeded("stopping.max_tokens", context, num_prompt_tokens, req.max_tokens, noun=noun)
    return req.max_tokens


async def after_think_block(
    req: ValidRequest, mode, prompt_ids: list[int], compiler=None, tenant: str = ""
) -> ValidRequest:
    """A reasoning model's format holds after its think block (common.structured.after_thinking),
    which the prompt left open (the template's `<think>`, or a raw prompt's) or the model may
    open itself. Compiled by `compiler` (router.grammar_compile.GrammarCompiler, for `tenant`)
    where given, else on common.structured's compile thread."""
    ids = prompt_ids[::-1]
    opened = mode.open_id in ids and ids.index(mode.open_id) < (
        ids.index(mode.close_id) if mode.close_id in ids else len(ids)
    )
    try:
        if compiler is not None:
            task = ("think", req.grammar, opened, mode.open_id, mode.close_id)
            grammar = await compiler.compile(task, tenant)
        else:
            grammar = await asyncio.get_running_loop().run_in_executor(
                compile_executor(), after_thinking, req.grammar, opened, mode.open_id, mode.close_id
            )
    except ValueError as exc:
        raise ValidationError("response_format", f"after the think block: {exc}") from None
    return dataclasses.replace(req, grammar=grammar)
