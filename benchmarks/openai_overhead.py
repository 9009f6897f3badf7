"""What the OpenAI-compatible front adds per request and per token on the router's CPU, in process:
JSON -> GenerateRequest (router/openai/requests.py) and TokenChunk -> SSE event
(router/openai/responses.py), the only work the HTTP front does that the gRPC front does not
(auth, validation, admission, queueing and relay are the same code). Not measured here: uvicorn's
HTTP parsing and socket writes (compare with bench-grpc's whole-stack figures).

Contract
- input: `--n` calls per batch (default 20000); each figure is the best of 5 batches.
- output: prints and returns {name: microseconds}: `parse_us` (one chat request body, json.loads
  included), `sse_chunk_us` (one token's chat chunk), `sse_chunk_top5_us` (with logprobs and 5
  alternatives), `whole_64_us` (a 64-token non-streaming completion body).
- state: none; deterministic inputs; timings are of this machine at this moment (noisy when the
  cores are shared).
- proven by: tests/test_openai_requests.py (it runs and every figure is positive).
"""

from __future__ import annotations

import argparse
import json
import time

from protos.llm.v1 import generation_pb2 as pb
from router.openai.requests import parse
from router.openai.responses import Responder

BODY = {
    "model": "",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 64,
    "temperature": 0.7,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def _per_call_us(fn, n: int, repeats: int = 5) -> float:
    """The best of `repeats` batches of n calls (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def run(n: int) -> dict[str, float]:
    raw = json.dumps(BODY).encode()
    parsed = parse(json.loads(raw), chat=True, request_id="r")
    plain = Responder(parsed, "model", lambda token_id: "x")
    chunk = pb.TokenChunk(token_ids=[42], text=" Paris")
    with_lp = parse({**BODY, "logprobs": True, "top_logprobs": 5}, chat=True, request_id="r")
    lp = Responder(with_lp, "model", lambda token_id: "x")
    top = pb.TopLogprobs(token_ids=[1, 2, 3, 4, 5], logprobs=[-0.1, -1.0, -2.0, -3.0, -4.0])
    lp_chunk = pb.TokenChunk(token_ids=[42], text=" Paris", logprobs=[-0.1], top_logprobs=[top])
    done = pb.Finished(reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=20, completion_tokens=64))
    whole = parse({"prompt": "x", "max_tokens": 64}, chat=False, request_id="r")
    completer = Responder(whole, "model", lambda token_id: "x")
    chunks = [pb.TokenChunk(token_ids=[i], text=f" w{i}") for i in range(64)]
    return {
        "parse_us": _per_call_us(lambda: parse(json.loads(raw), chat=True, request_id="r"), n),
        "sse_chunk_us": _per_call_us(lambda: plain.delta(chunk), n),
        "sse_chunk_top5_us": _per_call_us(lambda: lp.delta(lp_chunk), n),
        "whole_64_us": _per_call_us(
            lambda: json.dumps(completer.complete([(chunks, done)])), max(1, n // 64)
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.openai_overhead", description=__doc__.split("\n")[0]
    )
    p.add_argument("--n", type=int, default=20000, help="repetitions of each operation")
    figures = run(p.parse_args(argv).n)
    for name, us in figures.items():
        print(f"{name:20s} {us:8.1f} us")
    return figures


if __name__ == "__main__":
    main()
