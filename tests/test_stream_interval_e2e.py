"""The worker's --stream-interval through real processes on 127.0.0.1: a worker started with
--stream-interval 3 and a router over it. Called directly (llm.v1.Worker/Generate) it streams the
same tokens and logprobs as the session's shared worker (interval 1) in messages of 1, 3, 3, ...
tokens. Through the router, a stop string completed by a token inside a 3-token message cuts the
message there: the token ids, logprobs, text and usage a client gets are those of one token per
message (the worker computed the rest of the message, which nobody sees).
"""

from __future__ import annotations

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests import procs

INTERVAL = 3
PROMPT = "Once upon a time, in a small village by the sea,"
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def interval_worker(logs):
    with procs.running_workers(logs, 1, "--stream-interval", str(INTERVAL)) as (worker,):
        yield worker


@pytest.fixture(scope="module")
def router(interval_worker, logs):
    with procs.running_router(logs, [interval_worker.address]) as proc:
        yield proc


def worker_call(address: str, prompt_ids: list[int], request_id: str) -> list[worker_pb2.WorkerResponse]:
    request = worker_pb2.WorkerRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=worker_pb2.WorkerSampling(
            temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True
        ),
    )
    with grpc.insecure_channel(address) as channel:
        return list(worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=120))


def test_same_tokens_and_logprobs_in_messages_of_the_interval(interval_worker, plain_worker, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    every = worker_call(plain_worker.address, prompt, "interval-e2e-1")
    held = worker_call(interval_worker.address, prompt, "interval-e2e-3")
    tokens = [t for m in every for t in m.token_ids]
    assert len(tokens) == MAX_TOKENS
    assert [t for m in held for t in m.token_ids] == tokens
    assert [lp for m in held for lp in m.logprobs] == [lp for m in every for lp in m.logprobs]
    sizes = [len(m.token_ids) for m in held if m.token_ids]
    assert sizes[0] == 1 and all(size == INTERVAL for size in sizes[1:-1]) and 1 <= sizes[-1] <= INTERVAL
    assert held[-1].HasField("finished") and held[-1].finished.num_output_tokens == MAX_TOKENS


def test_stop_string_inside_a_message_cuts_it_there(router, interval_worker, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    tokens = [
        t for m in worker_call(interval_worker.address, prompt, "interval-e2e-ref") for t in m.token_ids
    ]
    # A token not last in its message (messages: [t0], [t1 t2 t3], [t4 t5 t6], ...) whose text is new.
    cut = next(
        i
        for i in range(1, MAX_TOKENS - 1)
        if i % INTERVAL != 0
        and len(piece := tokenizer.decode([tokens[i]]).strip()) >= 2
        and piece not in tokenizer.decode(tokens[:i])
    )
    stop = tokenizer.decode([tokens[cut]]).strip()
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, logprobs=1),
        stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]),
    )
    chunks, finished = [], None
    with grpc.insecure_channel(router.address) as channel:
        for msg in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            if msg.HasField("chunk"):
                chunks.append(msg.chunk)
            else:
                finished = msg.finished
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    full = tokenizer.decode(tokens)
    assert ids == tokens[: cut + 1], (cut, stop)  # not the rest of the completing token's message
    assert sum(len(c.logprobs) for c in chunks) == len(ids)
    assert text == full[: full.index(stop)]
    assert finished.reason == pb.FINISH_REASON_STOP and finished.stop_string == stop
    assert finished.usage.completion_tokens == cut + 1
