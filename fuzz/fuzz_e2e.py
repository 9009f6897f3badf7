"""End-to-end fuzzing at scale: hostile gRPC calls and hostile HTTP requests against real worker
and router processes on 127.0.0.1.

    python -m fuzz.fuzz_e2e --grpc-calls 10000 --http-calls 2000 [--seed 9] [--worker HOST:PORT]

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
- afterwards the worker's KV pool is whole, the router still serves, and its log holds no
  traceback.
- output: counts by status on stdout and as JSON in `--out`; exit status 1 when a check failed.
- proven by: tests/test_trust_fuzz.py (a short run in `make test`, the full one with --runslow).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pathlib
import random
import sys
import tempfile
import time
import urllib.error
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz.fuzz_e2e", description=__doc__.splitlines()[0])
    p.add_argument("--grpc-calls", type=int, default=10_000)
    p.add_argument("--http-calls", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--out", default=str(REPO / "docs" / "reliability" / "fuzz_e2e.json"))
    p.add_argument("--worker", default="", help="host:port of a running worker to use (default: start one)")
    a = p.parse_args(argv)
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
    checks = {
        "grpc_no_unknown_or_internal": not bad_grpc,
        "http_no_5xx": not bad_http,
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
        "checks": checks,
    }
    print(json.dumps(result, indent=2))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
