"""End-to-end fuzzing at scale: hostile gRPC calls and hostile HTTP requests against real worker
and router processes on 127.0.0.1.

    python -m fuzz.fuzz_e2e --grpc-calls 10000 --http-calls 2000 [--amplify-calls 200]
        [--amplify-scale 1] [--amplify-kinds KIND,...] [--seed 9] [--worker HOST:PORT]

Contract
- input: counts, a seed (every input is drawn from `random.Random(seed)`), an output path; the
  worker is started here, or `--worker` names one already serving (its KV pool must be whole at the
  end, so nothing else may use it meanwhile; it is not stopped).
- gRPC: the generators of tests/test_fuzz_e2e.py (every request field hostile now and then,
  hostile metadata, raw and corrupted protobuf bytes, tiny deadlines) through `Generate` and
  `ListModels`, 16 at a time. Every status must be one a client can act on (tests/test_fuzz_e2e.py
  ALLOWED): never UNKNOWN or INTERNAL; a stream that ends OK ends with exactly one Finished.
- HTTP (the OpenAI-compatible front, router/openai): `/v1/chat/completions` and `/v1/completions`
  (streamed or not; other servers' structured-output parameters among the fields), `/v1/embeddings`,
  `/v1/responses`, with bodies from valid to hostile (wrong types, huge and non-finite numbers,
  deep nesting, unknown fields, invalid JSON, non-UTF-8 bytes, huge strings), bad keys, and
  `GET /v1/models`. Every response must be below 500.
- amplify (issue 45, "one request must not stall everyone"): size-amplifying HTTP bodies near and
  over every bound (`AMPLIFY_KINDS`: `n` 16/17 x prompts of 100k-1M characters, logit_bias of
  300/301/100k entries, 8/9/10k stop strings, 1k-20k messages, 128/129 tools with large schemas,
  tool histories with ~900k-character arguments, 16/17 batch prompts, 100k-1M token ids, 2,048/2,049
  embedding inputs, deep/wide/$ref-chained json_schema formats, Responses inputs, /tokenize and
  /detokenize at their bounds, 1-16 MiB bodies and one byte over), 2 at a time, the right key 9 in
  10; `--amplify-scale` shrinks their sizes (embedding input counts by its square). Every status
  must be below 500 and none may hang (120 s). The router's event-loop lag (router/observe.py
  `EventLoopLag`, scraped every 0.5 s from its /metrics) over the phase is reported, not checked:
  the worst, the share of 50-ms samples over 50 ms (PASS/MISS against that goal), and for each
  scrape interval with a late sample the calls in flight in it (their kind, shape and status).
- afterwards the worker's KV pool is whole, the router still serves, and its log holds no
  traceback.
- output: counts by status on stdout and as JSON in `--out` (with the amplify phase's report, the
  command, CPU and load average); exit status 1 when a check failed.
- proven by: tests/test_trust_fuzz.py (a short run in `make test`, the full one with --runslow).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests import procs
from tests.openai_helpers import http_url
from tests.test_fuzz_e2e import (
    ALLOWED,
    AUTH,
    FUZZ_KEY,
    TENANTS,
    WRONG_KEY,
    hostile_bytes,
    hostile_metadata,
    hostile_request,
    outcome,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
HOSTILE_VALUES = [
    None,
    -1,
    0,
    2**31,
    2**63,
    10**400,
    -(10**30),
    1e308,
    "NaN",
    "Infinity",
    "",
    "x" * 5000,
    [],
    [None],
    {},
    {"a": {"b": {"c": []}}},
    True,
    "\x00\ud7ff",
    [1] * 300,
]
# Structured output's formats, valid and not: llguidance must refuse or bound each (router compile,
# worker matcher), never hang or crash a process.
HOSTILE_FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a{1,1000}){1,1000}"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10**9}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": ["integer", "nope"]}}},
    {"type": "json_schema", "json_schema": {"schema": [1, 2]}},
    {"type": "json_schema"},
    {"type": "regex", "regex": "(a|aa)*b"},
    {"type": 5},
]
# Tool calling: tools, choices and histories, valid and not (a schema llguidance refuses, names the
# validation refuses, arguments that are not objects, calls on the wrong role).
F_OK = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HOSTILE_TOOLS = [
    [F_OK],
    [F_OK, F_OK],
    [{"type": "function", "function": {"name": "g h"}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(a+)+$"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
    [{"type": "function", "function": {"name": "x" * 65}}],
    [{"type": "code_interpreter"}],
    [{"type": "function", "function": {"name": f"f{i}"}} for i in range(130)],
]
HOSTILE_CHOICES = [
    "auto",
    "none",
    "required",
    {"type": "function", "function": {"name": "f"}},
    "f",
    {"x": 1},
    3,
]
HOSTILE_HISTORY = [
    {
        "role": "assistant",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
    },
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[]"}}]},
    {"role": "assistant", "content": None, "tool_calls": "x"},
    {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "1"},
    {"role": "tool", "tool_call_id": ["1"]},
]
PARAMS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "priority",
    "user",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "messages",
    "prompt",
    "echo",
    "suffix",
    "best_of",
    *("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
    *("json_schema", "grammar", "regex", "ebnf"),
]
HOSTILE_INPUTS = [
    *("", "x", "é" * 50, "\x00", "word " * 9000),
    *(["a", "b"], ["a", ""], [1, 2], [[1], [2]], [[]], [], [True], [-1], [[2**40]], [["a"]]),
    *(["x"] * 2049, [{"a": 1}], None, 5, {"input": "x"}),
]


def hostile_embedding(rng: random.Random, model: str) -> bytes:
    body: dict = {"model": model, "input": rng.choice(HOSTILE_INPUTS)}
    for name, values in (
        ("encoding_format", ["float", "base64", "int8", 1, None]),
        ("pooling", ["last", "mean", "max", 0, None]),
        ("normalize", [True, False, "yes", None]),
        ("dimensions", [None, 8, -1, "x"]),
    ):
        if rng.random() < 0.3:
            body[name] = rng.choice(values)
    return json.dumps(body).encode()


def hostile_body(rng: random.Random, model: str, chat: bool) -> bytes:
    r = rng.random()
    if r < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))  # not JSON, maybe not UTF-8
    if r < 0.08:
        return rng.choice([b"[]", b"null", b"1", b'"x"', b"{", b'{"a":' * 200, b"[" * 5000])
    body: dict = {"model": model, "max_tokens": rng.choice([1, 2, 4])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Tell me", "\x00", "é" * 50])}]
    else:
        body["prompt"] = rng.choice(["Hi", "Once", ["a", "b"], [1, 2, 3]])
    body["stream"] = rng.random() < 0.4
    for _ in range(rng.choice([0, 0, 1, 2, 4])):
        body[rng.choice(PARAMS)] = rng.choice(HOSTILE_VALUES)
    if rng.random() < 0.05:
        body[rng.choice(PARAMS)] = rng.uniform(-1e6, 1e6)
    if rng.random() < 0.1:
        body["response_format"] = rng.choice(HOSTILE_FORMATS)
    if chat and rng.random() < 0.1:
        body["tools"] = rng.choice(HOSTILE_TOOLS)
        body["tool_choice"] = rng.choice(HOSTILE_CHOICES)
    if chat and rng.random() < 0.05 and isinstance(body["messages"], list):
        body["messages"] = [*body["messages"], rng.choice(HOSTILE_HISTORY), *body["messages"]]
    if rng.random() < 0.05:
        body["n"] = rng.choice([2, 16, 17])
    text = json.dumps(body, allow_nan=True)
    if rng.random() < 0.03:
        text = text.replace("1", "NaN", 1) if rng.random() < 0.5 else text + " " * rng.randint(0, 10)
    return text.encode()


async def run_grpc(address: str, model: str, rng: random.Random, n: int) -> collections.Counter:
    results: collections.Counter[str] = collections.Counter()
    limit = asyncio.Semaphore(16)
    async with grpc.aio.insecure_channel(address) as channel:

        def callable_for(method: str, raw: bool):
            serialize = (lambda b: b) if raw else (lambda m: m.SerializeToString())
            path = f"/llm.v1.Generation/{method}"
            if method == "Generate":
                return channel.unary_stream(
                    path, request_serializer=serialize, response_deserializer=pb.GenerateResponse.FromString
                )
            reply = {"ListModels": pb.ListModelsResponse, "Tokenize": pb.TokenizeResponse}.get(
                method, pb.DetokenizeResponse
            )
            return channel.unary_unary(
                path, request_serializer=serialize, response_deserializer=reply.FromString
            )

        async def one(i: int) -> None:
            method = rng.choices(["Generate", "ListModels", "Tokenize", "Detokenize"], [90, 4, 3, 3])[0]
            raw = rng.random() < 0.12
            if method == "Generate":
                payload = hostile_bytes(rng, model, i) if raw else hostile_request(rng, model, i)
            elif raw:
                payload = hostile_bytes(rng, model, i) if method != "ListModels" else b"\x0a\x01\xff"
            elif method == "Tokenize":
                req = hostile_request(rng, model, i)
                payload = pb.TokenizeRequest(model=req.model)
                if req.WhichOneof("input") == "chat":
                    payload.chat.CopyFrom(req.chat)
                else:
                    payload.prompt = req.prompt
            elif method == "Detokenize":
                ids = [rng.choice([0, 1, 2, 49151, 49152, 2**32 - 1]) for _ in range(rng.randint(0, 20))]
                payload = pb.DetokenizeRequest(model=rng.choice([model, "", "nope"]), token_ids=ids)
            else:
                payload = pb.ListModelsRequest()
            timeout = rng.uniform(0.001, 0.3) if rng.random() < 0.12 else 60.0
            metadata = hostile_metadata(rng)
            async with limit:
                call = callable_for(method, raw)(payload, metadata=metadata, timeout=timeout)
                status, _ = await outcome(call, streaming=method == "Generate")
                results[status] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return results


def http_status(method: str, url: str, body: bytes | None, key: str) -> int:
    """The status of one raw request (urllib: no client-side checks in the way); a response body
    is read to its end, so a stream that fails midway counts."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


async def run_http(base: str, model: str, rng: random.Random, n: int) -> collections.Counter:
    results: collections.Counter[str] = collections.Counter()
    limit = asyncio.Semaphore(8)

    async def one() -> None:
        r = rng.random()
        key = rng.choices([FUZZ_KEY, WRONG_KEY, "", "k" * 5000], weights=[90, 4, 3, 3])[0]
        if r < 0.03:
            call = ("GET", f"{base}/models", None)
        elif r < 0.1:
            call = ("POST", f"{base}/embeddings", hostile_embedding(rng, model))
        elif r < 0.14:  # the Responses API: a chat body's messages as its input
            body = hostile_body(rng, model, True).replace(b'"messages"', b'"input"', 1)
            call = ("POST", f"{base}/responses", body)
        elif r < 0.17:  # the token endpoints (vLLM's paths, beside /v1)
            root = base.removesuffix("/v1")
            if rng.random() < 0.5:
                call = ("POST", f"{root}/tokenize", hostile_body(rng, model, rng.random() < 0.5))
            else:
                ids = rng.choice([[1, 2], [-1], [2**40], "x", [True], list(range(300))])
                call = ("POST", f"{root}/detokenize", json.dumps({"tokens": ids}).encode())
        else:
            chat = r < 0.6
            url = f"{base}/chat/completions" if chat else f"{base}/completions"
            call = ("POST", url, hostile_body(rng, model, chat))
        async with limit:
            status = await asyncio.to_thread(http_status, *call, key)
        results[str(status)] += 1

    await asyncio.gather(*(one() for _ in range(n)))
    return results


# ---------------------------------------------------------------- amplify: size-amplifying bodies
# Bodies that cost the router far more than their count suggests, near and over every bound
# (router/config.py Limits, router/openai/requests.py MAX_CHOICES, router/validation.py
# MAX_LOGIT_BIAS, router/chat_validation.py MAX_TOOLS, router/token_api.py MAX_DETOKENIZE_IDS,
# router/openai/embeddings.py MAX_INPUTS, common/structured.py MAX_GRAMMAR_BYTES, the 16 MiB body).
# Each call is drawn as a (kind, seed) pair from the run's rng and its bytes built from its own
# `random.Random(seed)` just before it is sent (2 in flight hold at most 2 bodies in memory).
MAX_BODY = 16 * 2**20
VOCAB_IDS = 49_152  # the test model's vocabulary; ids past it are refused, which is fine


def _text(n: int) -> str:
    """n characters of words, built by repetition (cheap at 1M)."""
    return ("lorem ipsum dolor " * (n // 18 + 1))[:n]


class _Amp:
    """One body's builder: `rng` its own, `scale` shrinks characters and large counts (not the
    count bounds' +1 overshoots, which are cheap)."""

    def __init__(self, rng: random.Random, model: str, scale: float):
        self.rng, self.model, self.scale = rng, model, scale

    def size(self, n: int) -> int:
        return max(1, int(n * self.scale))

    def costly(self, n: int) -> int:
        """A count of inputs the worker computes one by one (embeddings): scale squared, so a tenth
        of the size is a hundredth of the worker's time (2,048 inputs take ~2 min on one thread)."""
        return max(1, int(n * self.scale**2))

    def chars(self, lo: int = 100_000, hi: int = 1_000_000) -> int:
        """A text length from lo to hi, often at hi (1M: --max-prompt-chars) or just over it."""
        r = self.rng.random()
        n = hi if r < 0.2 else hi + 1 if r < 0.3 else self.rng.randint(lo, hi)
        return self.size(n)

    def chat(self, content: str, **extra) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        body["stream"] = self.rng.random() < 0.3
        return {**body, **extra}

    def n(self) -> int:
        return self.rng.choice([1, 2, 16, 16, 17])

    # each returns (path, body, shape): path under the server root, body JSON-able or bytes
    def n_content(self):
        n, chars = self.n(), self.chars()
        return "/v1/chat/completions", self.chat(_text(chars), n=n), f"chat n={n} content={chars}"

    def n_prompt(self):
        n, chars = self.n(), self.chars()
        body = {"model": self.model, "prompt": _text(chars), "n": n, "max_tokens": 1}
        if self.rng.random() < 0.3:
            body["best_of"] = n
        return "/v1/completions", body, f"completions n={n} prompt={chars}"

    def logit_bias(self):
        k = self.rng.choice([300, 300, 301, self.size(100_000)])
        n = self.rng.choice([1, 16])
        bias = {str(i % VOCAB_IDS if k <= 301 else i): (-100, 5, 100)[i % 3] for i in range(k)}
        return "/v1/chat/completions", self.chat("Hi", logit_bias=bias, n=n), f"chat n={n} logit_bias={k}"

    def stop(self):
        k = self.rng.choice([8, 8, 9, self.size(10_000)])
        stop = [("s%d" % i + "x" * 64)[: self.rng.choice([63, 64, 65])] for i in range(k)]
        n = self.rng.choice([1, 16])
        return "/v1/chat/completions", self.chat("Hi", stop=stop, n=n), f"chat n={n} stop={k}x~64"

    def messages(self):
        k = self.rng.choice([10_000, 10_001, self.rng.randint(1_000, 20_000)])
        k = self.size(k) if self.scale < 1 else k
        msgs = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(k - 1)]
        msgs.append({"role": "user", "content": "go"})
        body = self.chat("", n=self.rng.choice([1, 16]))
        body["messages"] = msgs
        return "/v1/chat/completions", body, f"chat messages={k} n={body['n']}"

    def _tools(self, k: int, props: int) -> list:
        desc = _text(self.size(200))
        params = {
            "type": "object",
            "properties": {f"p{j}": {"type": "string", "description": desc} for j in range(props)},
            "required": [f"p{j}" for j in range(min(props, 8))],
        }
        return [
            {"type": "function", "function": {"name": f"f{i}", "description": desc, "parameters": params}}
            for i in range(k)
        ]

    def tools(self):
        k, props = self.rng.choice([128, 128, 129]), max(4, self.size(self.rng.choice([4, 40, 200])))
        choice = self.rng.choice(["auto", "required", {"type": "function", "function": {"name": "f7"}}])
        body = self.chat("Hi", tools=self._tools(k, props), tool_choice=choice)
        return "/v1/chat/completions", body, f"chat tools={k} properties={props} tool_choice={choice}"

    def tool_history(self):
        chars, calls = self.chars(10_000, 900_000), self.rng.choice([1, 1, 8, 64])
        args = json.dumps({"data": _text(max(1, chars // calls))})
        history = [{"role": "user", "content": "call f"}]
        ids = [f"c{i}" for i in range(calls)]
        history.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": c, "type": "function", "function": {"name": "f0", "arguments": args}} for c in ids
                ],
            }
        )
        history += [{"role": "tool", "tool_call_id": c, "content": "ok"} for c in ids]
        body = self.chat("", tools=self._tools(1, 4), n=self.rng.choice([1, 16]))
        body["messages"] = history
        return (
            "/v1/chat/completions",
            body,
            f"chat tool_calls={calls} arguments={len(args)}x{calls} n={body['n']}",
        )

    def batch(self):
        k = self.rng.choice([16, 16, 17])
        each = self.size(self.rng.choice([10_000, 60_000, 250_000, 900_000]))
        each = min(each, (MAX_BODY - 4096) // k)  # near the 16 MiB body, not over
        body = {"model": self.model, "prompt": [_text(each)] * k, "max_tokens": 1}
        return "/v1/completions", body, f"completions prompts={k}x{each}"

    def token_ids(self):
        if self.rng.random() < 0.5:
            k = self.rng.choice([self.size(100_000), 1_000_000 if self.scale >= 1 else 100_001])
            prompt, shape = [i % VOCAB_IDS for i in range(k)], f"ids={k}"
        else:
            k = self.rng.choice([16, 17])
            prompt, shape = [list(range(self.size(6_000)))] * k, f"id lists={k}x{self.size(6_000)}"
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "n": self.rng.choice([1, 16])}
        return "/v1/completions", body, f"completions {shape} n={body['n']}"

    def embeddings(self):
        r = self.rng.random()
        if r < 0.4:  # the count bound: 2,048 inputs are 2,048 pipeline calls
            k = self.rng.choice([self.costly(2_048), 2_049])
            inputs, shape = ["x"] * k, f"inputs={k}x1"
        elif r < 0.7:  # long inputs, most past the model's context
            k, each = self.rng.choice([16, 64]), self.size(self.rng.choice([1_000, 50_000]))
            inputs, shape = [_text(each)] * k, f"inputs={k}x{each}"
        elif r < 0.85:  # 2,048 texts past the test model's context (1,088 tokens): ~16 MiB
            k, each = self.size(2_048), 8_000
            inputs, shape = [_text(each)] * k, f"inputs={k}x{each}"
        else:
            k = self.rng.choice([self.costly(256), 2_049])
            inputs, shape = [[1, 2, 3]] * k, f"id inputs={k}x3"
        return "/v1/embeddings", {"model": self.model, "input": inputs}, f"embeddings {shape}"

    def _schema_format(self, schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}

    def schema_deep(self):
        """Nested `properties`, as text (json.dumps recurses: 5,000 levels overflow its stack)."""
        depth = self.rng.choice([16, 31, 32, 33, 63, 64, 65, 500, 5_000])
        width = self.rng.choice([1, 8, 60])
        siblings = "".join(f',"k{j}":{{"type":"integer"}}' for j in range(width - 1))
        schema = (
            '{"type":"object","properties":{"a":' * depth
            + '{"type":"string"}'
            + (siblings + '},"required":["a"]}') * depth
        )
        body = json.dumps(self.chat("Hi", response_format=self._schema_format("@SCHEMA@")))
        shape = f"json_schema depth={depth} width={width} ({len(schema)} bytes)"
        return "/v1/chat/completions", body.replace('"@SCHEMA@"', schema).encode(), shape

    def schema_wide(self):
        k = self.rng.choice([100, 1_000, self.size(10_000)])
        key = self.rng.choice(["allOf", "anyOf", "oneOf"])
        schema = {
            key: [{"type": "string", "pattern": f"^(a|b{{{i}}})+c[0-9]{{1,{i + 1}}}$"} for i in range(k)]
        }
        fmt = self._schema_format(schema)
        return "/v1/chat/completions", self.chat("Hi", response_format=fmt), f"json_schema {key}={k} patterns"

    def schema_refs(self):
        k = self.rng.choice([100, 1_000, self.size(5_000)])
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(k)}
        cycle = self.rng.random() < 0.3
        defs[f"d{k}"] = (
            {"$ref": "#/$defs/d0"} if cycle else {"type": "object", "properties": {"x": {"type": "string"}}}
        )
        schema = {"$defs": defs, "$ref": "#/$defs/d0"}
        fmt = self._schema_format(schema)
        return (
            "/v1/chat/completions",
            self.chat("Hi", response_format=fmt),
            f"json_schema $ref chain={k} cycle={cycle}",
        )

    def responses(self):
        r = self.rng.random()
        if r < 0.4:
            chars = self.chars()
            body, shape = {"input": _text(chars)}, f"input={chars}"
        elif r < 0.7:
            k = self.size(self.rng.choice([1_000, 10_000, 10_001]))
            body = {"input": [{"role": "user", "content": "hi"} for _ in range(k)]}
            shape = f"input items={k}"
        else:
            chars = self.chars(10_000, 900_000)
            body = {
                "input": [
                    {"role": "user", "content": "call f"},
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f0",
                        "arguments": json.dumps({"d": _text(chars)}),
                    },
                    {"type": "function_call_output", "call_id": "c", "output": "ok"},
                ],
                "tools": [{"type": "function", **t["function"]} for t in self._tools(128, 20)],
            }
            shape = f"function_call arguments={chars} tools=128"
        body |= {"model": self.model, "max_output_tokens": 1, "stream": self.rng.random() < 0.3}
        return "/v1/responses", body, f"responses {shape}"

    def tokenize(self):
        if self.rng.random() < 0.5:
            chars = self.chars()
            return "/tokenize", {"model": self.model, "prompt": _text(chars)}, f"tokenize prompt={chars}"
        k = self.size(self.rng.choice([1_000, 10_000, 10_001]))
        msgs = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(k)]
        return "/tokenize", {"model": self.model, "messages": msgs}, f"tokenize messages={k}"

    def detokenize(self):
        k = self.rng.choice([self.size(100_000), 131_072, 131_073])
        return (
            "/detokenize",
            {"model": self.model, "tokens": [i % VOCAB_IDS for i in range(k)]},
            f"detokenize ids={k}",
        )

    def big_body(self):
        """1-16 MiB (and just over): an unknown field's padding, whitespace, or a content past
        --max-prompt-chars."""
        size = self.rng.choice([2**20, 4 * 2**20, 8 * 2**20, MAX_BODY - 512, MAX_BODY + 1])
        size = self.size(size) if self.scale < 1 else size
        r = self.rng.random()
        if r < 0.4:
            head = json.dumps(self.chat("Hi"))[:-1] + ', "padding": "'
            body, shape = (head + "x" * max(0, size - len(head) - 2) + '"}').encode(), "unknown field"
        elif r < 0.7:
            head = json.dumps(self.chat("Hi"))
            body, shape = (head[:-1] + " " * max(0, size - len(head)) + "}").encode(), "whitespace"
        else:
            head = json.dumps(self.chat(""))
            body, shape = json.dumps(self.chat(_text(max(1, size - len(head))))).encode(), "content"
        return "/v1/chat/completions", body, f"body={len(body)} bytes ({shape})"


AMPLIFY_KINDS = {
    "n_content": 10,
    "n_prompt": 6,
    "logit_bias": 6,
    "stop": 5,
    "messages": 7,
    "tools": 6,
    "tool_history": 7,
    "batch": 6,
    "token_ids": 6,
    "embeddings": 6,
    "schema_deep": 6,
    "schema_wide": 5,
    "schema_refs": 5,
    "responses": 7,
    "tokenize": 5,
    "detokenize": 4,
    "big_body": 8,
}


def amplify_call(kind: str, seed: int, model: str, scale: float) -> tuple[str, bytes, str]:
    """One amplifying call's (path, body bytes, shape) from its kind and its own seed."""
    path, body, shape = getattr(_Amp(random.Random(seed), model, scale), kind)()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return path, data, shape


def _send(url: str, body: bytes, key: str) -> str:
    """One POST's status, its answer read to the end. A server that answers before it has read the
    whole body (413, 408, 503) and closes breaks the upload: the answer is then read from what it
    sent, its status suffixed "/early"; a connection closed with no answer is "conn:<error>", a
    call unanswered after 120 s "hung"."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    early = ""
    try:
        conn.putrequest("POST", parts.path)
        for name, value in (
            ("Authorization", f"Bearer {key}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ):
            conn.putheader(name, value)
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            early = "/early"
        reply = conn.getresponse()
        reply.read()
        return f"{reply.status}{early}"
    except TimeoutError:
        return "hung"
    except (ConnectionError, http.client.HTTPException) as err:
        return f"conn:{type(err).__name__}{early}"
    finally:
        conn.close()


class LoopLagSampler:
    """The router's loop-lag metrics (router/observe.py EventLoopLag), scraped every `every_s`
    from a thread (the /metrics server is a thread of its own, so a stalled loop does not delay it):
    the histogram's sample count and its le=0.05 bucket, the 1-s window's worst and the max since
    start, each with the time it was read."""

    NAME = "llm_router_event_loop_lag_samples_seconds"

    def __init__(self, router, every_s: float = 0.5):
        self.router, self.every_s = router, every_s
        self.readings: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-lag-sampler", daemon=True)

    def read(self) -> dict:
        page = procs.scrape(self.router)
        return {
            "t": time.monotonic(),
            "count": page[(f"{self.NAME}_count", ())],
            "le_0.05": page[(f"{self.NAME}_bucket", (("le", "0.05"),))],
            "window_s": page[("llm_router_event_loop_lag_seconds", ())],
            "max_s": page[("llm_router_event_loop_lag_max_seconds", ())],
            "closed": {
                dict(labels).get("reason", ""): v
                for (name, labels), v in page.items()
                if name == "llm_router_http_connections_closed_total"
            },
        }

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.readings.append(self.read())
            except OSError:  # a scrape that failed: the next one tells
                continue

    def __enter__(self):
        self.before = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        self.after = self.read()


async def run_amplify(
    base: str,
    router,
    model: str,
    rng: random.Random,
    n: int,
    scale: float,
    kinds: dict[str, int] | None = None,
) -> tuple[collections.Counter, dict]:
    """n size-amplifying calls, 2 at a time; -> (statuses, the phase's report: loop lag, per-kind
    statuses and seconds, the kinds in flight when the loop was late)."""
    root = base.removesuffix("/v1")
    kinds = kinds or AMPLIFY_KINDS
    draws = [
        (
            rng.choices(list(kinds), list(kinds.values()))[0],
            rng.getrandbits(32),
            rng.random() < 0.9,
        )
        for _ in range(n)
    ]
    limit = asyncio.Semaphore(2)
    calls: list[dict] = []

    def one_call(kind: str, seed: int, right_key: bool) -> dict:
        try:
            path, body, shape = amplify_call(kind, seed, model, scale)
        except Exception as exc:  # noqa: BLE001 - the fuzzer's own bug: reported, the run goes on
            now = time.monotonic()
            status = f"fuzzer:{type(exc).__name__}"
            return {
                "kind": kind,
                "shape": f"seed {seed}",
                "bytes": 0,
                "key": right_key,
                "status": status,
                "start": now,
                "end": now,
            }
        start = time.monotonic()
        status = _send(root + path, body, FUZZ_KEY if right_key else WRONG_KEY)
        return {
            "kind": kind,
            "shape": shape,
            "bytes": len(body),
            "key": right_key,
            "status": status,
            "start": start,
            "end": time.monotonic(),
        }

    async def one(draw) -> None:
        async with limit:
            calls.append(await asyncio.to_thread(one_call, *draw))

    with LoopLagSampler(router) as lag:
        t0 = time.monotonic()
        await asyncio.gather(*(one(d) for d in draws))
        seconds = time.monotonic() - t0
    return collections.Counter(c["status"] for c in calls), lag_report(lag, calls, seconds)


def lag_report(lag: LoopLagSampler, calls: list[dict], seconds: float) -> dict:
    """The phase's loop lag and which calls were in flight when it was late: each scrape interval's
    samples over 50 ms go to every kind with a call in flight during it."""
    readings = [lag.before, *lag.readings, lag.after]
    late_by_kind: collections.Counter[str] = collections.Counter()
    late_intervals = []
    for prev, cur in zip(readings, readings[1:]):
        late = (cur["count"] - cur["le_0.05"]) - (prev["count"] - prev["le_0.05"])
        if late <= 0 and cur["max_s"] <= prev["max_s"]:
            continue
        running = [c for c in calls if c["start"] < cur["t"] and c["end"] > prev["t"]]
        for kind in {c["kind"] for c in running}:
            late_by_kind[kind] += late
        late_intervals.append(
            {
                "at_s": round(cur["t"] - lag.before["t"], 2),
                "samples_over_50ms": int(late),
                "window_worst_ms": round(cur["window_s"] * 1e3, 1),
                "new_max_ms": round(cur["max_s"] * 1e3, 1) if cur["max_s"] > prev["max_s"] else None,
                "in_flight": sorted(
                    f"{c['kind']}: {c['shape']} -> {c['status']}"
                    + (" (started)" if c["start"] >= prev["t"] else "")
                    + (" (ended)" if c["end"] <= cur["t"] else "")
                    for c in running
                ),
            }
        )
    samples = lag.after["count"] - lag.before["count"]
    over = samples - (lag.after["le_0.05"] - lag.before["le_0.05"])
    worst_s = max(
        [lag.after["max_s"] if lag.after["max_s"] > lag.before["max_s"] else 0.0]
        + [r["window_s"] for r in readings[1:]]
    )
    by_kind: dict[str, dict] = {}
    for c in calls:
        k = by_kind.setdefault(c["kind"], {"calls": 0, "statuses": collections.Counter(), "max_seconds": 0.0})
        k["calls"] += 1
        k["statuses"][c["status"]] += 1
        k["max_seconds"] = round(max(k["max_seconds"], c["end"] - c["start"]), 2)
    slowest = sorted(calls, key=lambda c: c["start"] - c["end"])[:5]
    return {
        "seconds": round(seconds, 1),
        "body_mb_sent": round(sum(c["bytes"] for c in calls) / 2**20, 1),
        "http_connections_closed_by_router": {
            r: int(v - lag.before["closed"].get(r, 0)) for r, v in lag.after["closed"].items()
        },
        "loop_lag_max_ms_before": round(lag.before["max_s"] * 1e3, 1),
        "loop_lag_max_ms_after": round(lag.after["max_s"] * 1e3, 1),
        "loop_lag_worst_ms_in_phase": round(worst_s * 1e3, 1),
        "loop_lag_goal_ms": 50,
        "loop_lag_goal": "PASS" if worst_s <= 0.05 else "MISS",
        "loop_lag_samples": int(samples),
        "loop_lag_samples_over_50ms": int(over),
        "loop_lag_share_over_50ms": round(over / samples, 4) if samples else 0.0,
        "samples_over_50ms_by_kind_in_flight": dict(late_by_kind.most_common()),
        "late_intervals": sorted(late_intervals, key=lambda i: -i["window_worst_ms"])[:40],
        "by_kind": {k: {**v, "statuses": dict(v["statuses"])} for k, v in sorted(by_kind.items())},
        "slowest_calls": [
            {
                "kind": c["kind"],
                "shape": c["shape"],
                "status": c["status"],
                "seconds": round(c["end"] - c["start"], 2),
            }
            for c in slowest
        ],
        "not_answered_or_early": [
            f"{c['kind']}: {c['shape']} -> {c['status']}" for c in calls if not c["status"].isdigit()
        ],
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except OSError:
        return ""
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), ""
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz.fuzz_e2e", description=__doc__.splitlines()[0])
    p.add_argument("--grpc-calls", type=int, default=10_000)
    p.add_argument("--http-calls", type=int, default=2_000)
    p.add_argument("--amplify-calls", type=int, default=200, help="size-amplifying HTTP bodies, 2 at a time")
    p.add_argument(
        "--amplify-scale", type=float, default=1.0, help="shrink the amplifying bodies' sizes (0.1: a tenth)"
    )
    p.add_argument(
        "--amplify-kinds",
        default=",".join(AMPLIFY_KINDS),
        help=f"comma-separated body kinds to draw from (default: all of {', '.join(AMPLIFY_KINDS)})",
    )
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--out", default=str(REPO / "docs" / "data" / "reliability" / "fuzz_e2e.json"))
    p.add_argument("--worker", default="", help="host:port of a running worker to use (default: start one)")
    a = p.parse_args(argv)
    kinds = {k: AMPLIFY_KINDS[k] for k in a.amplify_kinds.split(",") if k in AMPLIFY_KINDS}
    if set(a.amplify_kinds.split(",")) - set(kinds):
        p.error(f"--amplify-kinds: unknown kinds {sorted(set(a.amplify_kinds.split(',')) - set(kinds))}")
    logs = pathlib.Path(tempfile.mkdtemp(prefix="fuzz-e2e-"))
    rng = random.Random(a.seed)
    worker = None if a.worker else procs.start_worker(logs, "--num-threads", "1")
    try:
        if worker is not None:
            procs.ready(worker)
        worker_address = a.worker or worker.address
        with procs.running_router(
            logs,
            [worker_address],
            "--default-max-tokens",
            "4",
            "--http-port",
            "0",
            "--metrics-port",
            "0",
            tenants=TENANTS,
            metadata=AUTH,
        ) as router:
            with grpc.insecure_channel(router.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                model = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=10).models[0].id
            start = time.monotonic()
            grpc_results = asyncio.run(run_grpc(router.address, model, rng, a.grpc_calls))
            grpc_s = time.monotonic() - start
            start = time.monotonic()
            http_results = asyncio.run(run_http(http_url(router), model, rng, a.http_calls))
            http_s = time.monotonic() - start
            load_before = os.getloadavg()
            amplify_results, amplify = asyncio.run(
                run_amplify(http_url(router), router, model, rng, a.amplify_calls, a.amplify_scale, kinds)
            )
            load_after = os.getloadavg()
            load, _ = procs.wait_all_blocks_free(worker_address, timeout_s=60)
            with grpc.insecure_channel(router.address) as channel:  # still serving
                msgs = list(
                    generation_pb2_grpc.GenerationStub(channel).Generate(
                        pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=2)),
                        metadata=AUTH,
                        timeout=60,
                    )
                )
            log = router.log_path.read_text(errors="replace")
    finally:
        if worker is not None:
            worker.stop()
    bad_grpc = {k: v for k, v in grpc_results.items() if k not in ALLOWED}
    bad_http = {k: v for k, v in http_results.items() if int(k) >= 500}
    bad_amplify = {
        k: v for k, v in amplify_results.items() if k == "hung" or (k[:3].isdigit() and int(k[:3]) >= 500)
    }
    checks = {
        "grpc_no_unknown_or_internal": not bad_grpc,
        "http_no_5xx": not bad_http,
        "amplify_no_5xx_or_hang": not bad_amplify,
        "kv_pool_whole": load.num_free_blocks == load.num_total_blocks,
        "router_still_serves": msgs[-1].HasField("finished"),
        "no_traceback_in_router_log": "Traceback" not in log and "unhandled error" not in log,
    }
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seed": a.seed,
        "grpc_calls": a.grpc_calls,
        "grpc_seconds": round(grpc_s, 1),
        "grpc_statuses": dict(grpc_results.most_common()),
        "http_calls": a.http_calls,
        "http_seconds": round(http_s, 1),
        "http_statuses": dict(http_results.most_common()),
        "amplify_calls": a.amplify_calls,
        "amplify_scale": a.amplify_scale,
        "amplify_kinds": list(kinds),
        "amplify_statuses": dict(amplify_results.most_common()),
        "amplify": amplify,
        "command": "python -m fuzz.fuzz_e2e " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_model(),
        "load_average_before_after_amplify": [
            [round(x, 2) for x in load_before],
            [round(x, 2) for x in load_after],
        ],
        "router_log_warnings": [line for line in log.splitlines() if " ERROR " in line or "WARNING" in line][
            :20
        ],
        "checks": checks,
    }
    print(json.dumps(result, indent=2))
    lag = amplify
    print(
        f"amplify: {a.amplify_calls} calls in {lag['seconds']} s, event-loop lag worst "
        f"{lag['loop_lag_worst_ms_in_phase']} ms ({lag['loop_lag_goal']} against the 50 ms goal), "
        f"{lag['loop_lag_samples_over_50ms']}/{lag['loop_lag_samples']} samples over 50 ms"
    )
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
