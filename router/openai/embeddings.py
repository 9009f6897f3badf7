"""POST /v1/embeddings: OpenAI's embeddings API over the generation pipeline.

Contract
- input: `{"input": str | [str] | [ids] | [[ids]], "model"?, "encoding_format"?: "float"
  (default) | "base64", "dimensions"?}` plus two extensions: `"pooling"?: "last" (default) |
  "mean"` and `"normalize"?: bool (default true)`; `user` and unknown keys are ignored.
- output: `{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [floats] |
  base64 of little-endian float32}], "model", "usage": {"prompt_tokens", "total_tokens"}}`, the
  vectors L2-normalized unless `normalize` is false.
- How: each input is one pipeline call (`GenerateRequest` with `sampling.pooling`, max_tokens 1:
  the worker pools the prompt's final hidden states and the generated token is left out), so
  authentication, admission, the fair queue, retries and cancellation are those of generations. At
  most `IN_FLIGHT` calls of one HTTP request run at once (a batch of 2,048 inputs is not 2,048
  admissions at once), fewer for a tenant whose concurrency or queue cap is lower
  (`in_flight`); the first failure cancels the others and is the answer's status. The answer is
  sent in pieces (`answer`), so encoding a large one does not hold the event loop.
- failure modes: `ApiError(400)` naming the parameter: no input, an empty string or token list,
  more than MAX_INPUTS inputs or than the tenant's request burst, a wrong type, `dimensions` (the
  model's hidden size is what it is), an unknown `encoding_format` or `pooling`; an input longer
  than the model's context is a 400 naming `input[i]`, code `context_length_exceeded`; a
  non-finite vector is a 500 before the answer starts; the pipeline's other errors as for
  completions (router/openai/app.py).
- state: none.
- proven by: tests/test_openai_embeddings_e2e.py (the openai SDK against real router and worker
  processes: the vectors against gRPC's, base64, batches, token ids, usage, the 400 table).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from protos.llm.v1 import generation_pb2 as pb
from router.admission import request_burst
from router.errors import RouterError, ValidationError
from router.openai.requests import UINT32_MAX, ApiError

MAX_INPUTS = 2048  # OpenAI's limit per request
IN_FLIGHT = 16  # pipeline calls of one request at once (router/openai/requests.py's MAX_CHOICES)
POOLINGS = {"last": pb.POOLING_LAST, "mean": pb.POOLING_MEAN}


@dataclass
class EmbeddingRequest:
    requests: list[pb.GenerateRequest]  # one per input, in index order
    model: str
    base64: bool = False
    normalize: bool = True


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _inputs(value) -> list[str | list[int]]:
    if value is None:
        raise _bad("input", "required: a string, a list of strings, or token ids (a list or a list of lists)")
    if isinstance(value, str) or (_is_ids(value) and value):
        inputs = [value]
    elif isinstance(value, list) and value:
        inputs = value
    elif isinstance(value, list):
        raise _bad("input", "must not be empty")
    else:
        raise _bad("input", f"must be a string, a list of strings, or token ids, got {type(value).__name__}")
    if len(inputs) > MAX_INPUTS:
        raise _bad("input", f"at most {MAX_INPUTS} inputs, got {len(inputs)}")
    for i, one in enumerate(inputs):
        where = f"input[{i}]" if isinstance(value, list) and not _is_ids(value) else "input"
        problem = None
        if isinstance(one, str):
            problem = None if one else "must not be an empty string"
        elif _is_ids(one):
            if not one:
                problem = "must not be an empty list of token ids"
            elif not all(0 <= t <= UINT32_MAX for t in one):
                problem = f"token ids must be in [0, {UINT32_MAX}]"
        else:
            problem = f"must be a string or a list of token ids, got {type(one).__name__}"
        if problem:
            raise ApiError(400, f"{where}: {problem}", param="input")
    return inputs


def parse_embeddings(body: object, request_id: str) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    inputs = _inputs(body.get("input"))
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    form = body.get("encoding_format") or "float"
    if form not in ("float", "base64"):
        raise _bad("encoding_format", f"must be float or base64, got {form!r}")
    if body.get("dimensions") is not None:
        raise _bad("dimensions", "not supported: embeddings have the model's hidden size")
    pooling = body.get("pooling") or "last"
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise _bad("pooling", f"must be last or mean, got {pooling!r}")
    normalize = body.get("normalize")
    normalize = True if normalize is None else normalize
    if not isinstance(normalize, bool):
        raise _bad("normalize", f"must be a boolean, got {type(normalize).__name__}")
    requests = []
    for i, one in enumerate(inputs):
        req = pb.GenerateRequest(
            request_id=f"{request_id}-{i}" if len(inputs) > 1 else request_id,
            model=model,
            sampling=pb.SamplingParams(temperature=0, pooling=POOLINGS[pooling]),
            stopping=pb.StoppingCriteria(max_tokens=1),
        )
        try:
            if isinstance(one, str):
                req.prompt = one
            else:
                req.token_ids.ids[:] = one
        except ValueError as exc:  # a string protobuf refuses (a lone surrogate)
            raise ApiError(400, f"input[{i}]: {exc}", param="input") from None
        requests.append(req)
    return EmbeddingRequest(requests, model, form == "base64", normalize)


async def _embed_one(events: AsyncIterator, index: int) -> tuple[list[float], int]:
    """One call's events -> (vector, prompt tokens); an input the pipeline refuses names itself."""
    vector = None
    try:
        async with aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, pb.Finished):
                    if vector is None:
                        raise RouterError("the worker returned no embedding")
                    return vector, event.usage.prompt_tokens
                if event.embedding:
                    vector = list(event.embedding)
    except ValidationError as exc:
        if exc.field in ("prompt", "token_ids.ids"):
            problem = exc.message.split(": ", 1)[1]
            raise ApiError(400, f"input[{index}]: {problem}", param="input", code=exc.openai_code) from None
        raise
    raise RouterError("the generation stream ended without a finish")


def in_flight(tenant, num_inputs: int) -> int:
    """How many of a request's calls run at once for this tenant: IN_FLIGHT, at most its
    concurrency and queue caps (each input is one request to admission). A batch larger than the
    tenant's request burst could never be admitted whole: a 400 that says how many fit."""
    burst = request_burst(tenant)
    if burst is not None and num_inputs > burst:
        raise _bad(
            "input",
            f"{num_inputs} inputs, more than the {int(burst)} requests tenant {tenant.name} may send at once "
            "(each input counts as one request): send smaller batches",
        )
    caps = [c for c in (tenant.max_concurrency, tenant.max_queued) if c is not None]
    return min([IN_FLIGHT, *caps])


async def embed(
    call: Callable[[pb.GenerateRequest], AsyncIterator], parsed: EmbeddingRequest, limit: int = IN_FLIGHT
):
    """[(vector, prompt tokens)] in input order; at most `limit` calls at once, the first failure
    cancels the rest and is raised."""
    slots = asyncio.Semaphore(limit)

    async def one(index: int, req: pb.GenerateRequest):
        async with slots:
            return await _embed_one(call(req), index)

    tasks = [asyncio.ensure_future(one(i, req)) for i, req in enumerate(parsed.requests)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def checked(parsed: EmbeddingRequest, results: list[tuple[list[float], int]]) -> list[list[float]]:
    """The vectors, L2-normalized when asked; a non-finite value (a broken model) is an error, found
    before the answer starts. Yields to the event loop every few vectors (pure Python: ~3 ms for
    4,096 floats)."""
    vectors = []
    for k, (vector, _) in enumerate(results):
        try:
            norm = math.sqrt(math.fsum(v * v for v in vector))
        except (ValueError, OverflowError):  # inf - inf, nan
            norm = math.nan
        if not math.isfinite(norm):
            raise RouterError("the model returned a non-finite embedding")
        vectors.append([v / norm for v in vector] if parsed.normalize and norm > 0 else vector)
        if k % 16 == 15:
            await asyncio.sleep(0)
    return vectors


async def answer(
    parsed: EmbeddingRequest, name: str, vectors: list[list[float]], prompt_tokens: int
) -> AsyncIterator[bytes]:
    """The response body, JSON in pieces of a few vectors: the event loop serves others between
    them (2,048 vectors of 4,096 floats are ~175 MB of JSON, ~10 s to encode). A yield alone does
    not give the loop back (the server's send returns at once while the socket takes the bytes),
    so every few vectors it sleeps 0: 2,048 vectors of 576 floats held the loop up to 3 s."""
    yield b'{"object":"list","data":['
    for index, vector in enumerate(vectors):
        if index % 4 == 3:
            await asyncio.sleep(0)
        embedding = vector
        if parsed.base64:
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        item = {"object": "embedding", "index": index, "embedding": embedding}
        yield (b"," if index else b"") + json.dumps(item, separators=(",", ":")).encode()
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    yield f'],"model":{json.dumps(name)},"usage":{json.dumps(usage)}}}'.encode()
