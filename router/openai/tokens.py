"""POST /tokenize and /detokenize bodies <-> the router's `Tokenize` / `Detokenize` protobufs, in
vLLM's form (llama.cpp's field names accepted too); POST /v1/load_lora_adapter and
/v1/unload_lora_adapter <-> `LoadLoraAdapter` / `UnloadLoraAdapter` (vLLM's bodies).

Contract
- input: /tokenize `{"model"?, "prompt": str, "add_special_tokens"?: bool (default true)}`
  (llama.cpp's form: `{"content": str, "add_special"?: bool (default false)}`) or `{"model"?,
  "messages": [...], "tools"?, "tool_choice"?}` (the chat as /v1/chat/completions renders it,
  generation prompt included), each with llama.cpp's `"with_pieces"?: bool`; /detokenize
  `{"model"?, "tokens": [ids]}`.
- output: `{"model", "tokens", "count", "max_model_len"}`, with `with_pieces` each token as
  llama.cpp gives it, `{"id", "piece"}`: the piece a string where its bytes are UTF-8 alone, else
  the list of its byte values / `{"model", "prompt", "content"}` (the text under both names:
  vLLM's and llama.cpp's).
- failure modes: `ApiError(400)` naming the parameter (no prompt or messages, a wrong type,
  `add_generation_prompt: false`, which this server does not do); the service's errors as for the
  other endpoints (router/openai/app.py).
- proven by: tests/test_openai_tokens_e2e.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from protos.llm.v1 import generation_pb2 as pb
from router.openai.requests import UINT32_MAX, ApiError, parse

T = TypeVar("T")


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param)


def _model(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    return model


def _request(build: Callable[[dict], T]) -> Callable[[object], T]:
    """A body -> protobuf builder: the body must be a JSON object, and a string protobuf refuses
    (a lone surrogate) is a 400, not a 500."""

    @functools.wraps(build)
    def checked(body: object) -> T:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return build(body)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, f"request: {exc}") from None

    return checked


@_request
def tokenize_request(body: dict) -> pb.TokenizeRequest:
    out = pb.TokenizeRequest(model=_model(body))
    with_pieces = body.get("with_pieces", False)
    if not isinstance(with_pieces, bool):
        raise _bad("with_pieces", "must be a boolean")
    out.with_pieces = with_pieces
    if "messages" in body:
        if body.get("add_generation_prompt", True) is not True:
            raise _bad(
                "add_generation_prompt", "only true is supported (the prompt ends with the assistant's turn)"
            )
        chat_fields = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
        out.chat.CopyFrom(parse(chat_fields, chat=True, request_id="tokenize").request.chat)
        return out
    # vLLM's {"prompt", "add_special_tokens": true by default} or llama.cpp's {"content",
    # "add_special": false by default}
    llama = body.get("prompt") is None and "content" in body
    param, flag = ("content", "add_special") if llama else ("prompt", "add_special_tokens")
    prompt = body.get(param)
    if not isinstance(prompt, str):
        raise _bad(param, "required: a string (or messages, for a chat)")
    out.prompt = prompt
    special = body.get(flag, not llama)
    if not isinstance(special, bool):
        raise _bad(flag, "must be a boolean")
    out.add_special_tokens = special
    return out


def _piece(raw: bytes) -> str | list[int]:
    """llama.cpp's form of a token's piece: its text, or its byte values where they are not UTF-8
    alone (a character split across tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize_answer(reply: pb.TokenizeResponse) -> dict:
    ids = list(reply.token_ids)
    tokens: list = ids
    if reply.pieces:  # with_pieces
        tokens = [{"id": i, "piece": _piece(p)} for i, p in zip(ids, reply.pieces, strict=True)]
    return {"model": reply.model, "tokens": tokens, "count": len(ids), "max_model_len": reply.max_model_len}


@_request
def detokenize_request(body: dict) -> pb.DetokenizeRequest:
    ids = body.get("tokens")
    ok = isinstance(ids, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in ids
    )
    if not ok:
        raise _bad("tokens", "required: a list of token ids")
    return pb.DetokenizeRequest(model=_model(body), token_ids=ids)


def detokenize_answer(reply: pb.DetokenizeResponse) -> dict:
    return {"model": reply.model, "prompt": reply.text, "content": reply.text}


@_request
def lora_request(body: dict) -> pb.LoraAdapterRequest:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's {"lora_name", "lora_path"}
    (the path only to load), and "base_model" where the router serves several."""
    fields = {}
    for param, key in (("lora_name", "name"), ("lora_path", "path"), ("base_model", "base_model")):
        value = body.get(param, "")
        if not isinstance(value, str):
            raise _bad(param, "must be a string")
        fields[key] = value
    if not fields["name"]:
        raise _bad("lora_name", "required: the model id requests will name the adapter by")
    return pb.LoraAdapterRequest(**fields)


def lora_answer(reply: pb.LoraAdapterReply) -> dict:
    return {
        "object": "lora_adapter",
        "lora_name": reply.name,
        "base_model": reply.base_model,
        "num_workers": reply.num_workers,
    }
