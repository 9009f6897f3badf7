"""One request must not stall everyone (the request path's order and bounds), against real router
and worker processes on 127.0.0.1:
- a wrong key, or a throttled tenant, is answered before the body is read (the client has sent
  only the headers and a first part of a 13 MB body when its 401 / 429 arrives);
- requests that cost O(body) work before their refusal (a 13 MB body of a million logit_bias
  entries with n 16, a chat history whose tool-call arguments are ~960k characters with n 16, a
  2 MB prompt) keep the router's event loop on time: no sample of the loop-lag monitor
  (`llm_router_event_loop_lag_samples_seconds`) above 50 ms while each is answered;
- the n choices of a request are validated and tokenized once (the router's tokenize counter).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import pytest

from tests import procs
from tests.openai_helpers import KEY, LIMITED_KEY, client, http_url, post, router, stub, worker  # noqa: F401

LAG = "llm_router_event_loop_lag_samples_seconds"
BIG_BIAS = {str(i): 1.0 for i in range(1_000_000)}  # ~13 MB of JSON


def lag_samples(proc) -> tuple[float, float]:
    """(samples in all, samples at most 50 ms late) of the router's loop-lag monitor."""
    samples = procs.scrape(proc)
    return samples[(f"{LAG}_count", ())], samples[(f"{LAG}_bucket", (("le", "0.05"),))]


def late_samples_while(proc, send) -> tuple[float, object]:
    """Loop-lag samples over 50 ms from just before `send()` until three samples after it returned
    (the sample that would catch a stall is taken when the loop runs again). -> (late, result)."""
    total0, fine0 = lag_samples(proc)
    result = send()
    seen = lag_samples(proc)[0]
    procs.wait_until(lambda: lag_samples(proc)[0] >= seen + 3, 10, "three more loop-lag samples")
    total1, fine1 = lag_samples(proc)
    return (total1 - total0) - (fine1 - fine0), result


def raw_start(url: str, path: str, key: str, length: int, first: bytes) -> socket.socket:
    """A POST whose headers announce `length` body bytes, of which only `first` is sent."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the response, read within the socket's timeout (TimeoutError otherwise)."""
    data = b""
    while b"\r\n" not in data:
        part = sock.recv(4096)
        if not part:
            raise ConnectionError(f"closed after {data!r}")
        data += part
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("key", "status"), [("wrong-key", 401), (LIMITED_KEY, 429)], ids=["wrong-key", "throttled"]
)
def test_a_refused_caller_is_answered_before_its_body_is_read(router, key, status):  # noqa: F811
    url = http_url(router)
    if status == 429:  # the limited tenant's one request of its burst, taken
        post(f"{url}/completions", json.dumps({"prompt": "hi", "max_tokens": 1}).encode(), LIMITED_KEY)
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 16, "logit_bias": BIG_BIAS})
    sock = raw_start(url, "/v1/chat/completions", key, len(body), body[:65536].encode())
    try:
        started = time.monotonic()
        assert status_of(sock) == status  # the rest of the 13 MB was never sent
        assert time.monotonic() - started < 5
    finally:
        sock.close()


def tool_history(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        "n": 16,
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }


def test_huge_bodies_and_histories_do_not_hold_the_event_loop(router):  # noqa: F811
    url = http_url(router)
    attacks = {
        # 12.9 MB: a million logit_bias entries, n 16 (refused by count, decoded off the loop)
        "logit_bias": (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 16, "logit_bias": BIG_BIAS},
        ),
        # a tool call whose arguments are ~960k characters of JSON array, n 16
        # a tool call whose arguments are ~958k characters (under the 1M cap): a JSON array (refused
        # as not an object) and an object (accepted, then too long once rendered), n 16
        "tool history (array)": ("/chat/completions", tool_history("[" + ",".join(["1"] * 479_000) + "]")),
        "tool history (object)": (
            "/chat/completions",
            tool_history('{"x":[' + ",".join(["1"] * 479_000) + "]}"),
        ),
        # 10,000 messages (the default bound), n 16: validated on a thread, then too long to fit
        "10k messages": (
            "/chat/completions",
            {
                "n": 16,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"m{i}"} for i in range(10_000)],
            },
        ),
        "2 MB prompt": ("/completions", {"prompt": "word " * 400_000, "n": 16, "max_tokens": 4}),
    }
    for name, (path, body) in attacks.items():
        data = json.dumps(body).encode()
        worst = []
        for _ in range(3):  # the least of 3 tries: a stall of this request's own is there every time
            late, (status, answer) = late_samples_while(router, lambda: post(f"{url}{path}", data, KEY))
            assert status == 400, (name, answer)
            worst.append(late)
            if late == 0:
                break
        assert min(worst) == 0, f"{name}: loop-lag samples over 50 ms in each try: {worst}"


def test_n_choices_are_tokenized_once(router, client):  # noqa: F811
    before = procs.scrape(router)[("llm_router_tokenize_calls_total", ())]
    answer = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Say hi"}], n=4, max_tokens=2, temperature=1.0
    )
    assert len(answer.choices) == 4
    assert procs.scrape(router)[("llm_router_tokenize_calls_total", ())] - before == 1


@pytest.fixture(scope="module")
def capped(worker, logs):  # noqa: F811
    """A router whose tenants may hold one open stream each."""
    from tests.openai_helpers import AUTH, TENANTS

    with procs.running_router(
        logs,
        [worker.address],
        "--http-port",
        "0",
        "--http-max-streams-per-tenant",
        "1",
        tenants=TENANTS,
        metadata=AUTH,
    ) as proc:
        yield proc


def test_a_tenants_open_streams_are_capped(capped):
    import openai

    from tests.openai_helpers import PAIR_KEY

    url = http_url(capped)
    args = dict(
        model="", prompt="Once upon a time", max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as client_a:  # noqa: F811
        first = client_a.completions.create(**args)
        next(iter(first))  # open, and streaming
        with pytest.raises(openai.RateLimitError, match="1 streams already open"):
            client_a.completions.create(**args)
        with openai.OpenAI(base_url=url, api_key=PAIR_KEY, max_retries=0, timeout=60) as other:
            assert sum(1 for _ in other.completions.create(**{**args, "max_tokens": 2})) >= 1  # not held back
        first.close()
        procs.wait_until(lambda: try_stream(client_a, args), 30, "the closed stream to be let go")


def try_stream(client_a, args) -> bool:
    import openai

    try:
        list(client_a.completions.create(**{**args, "max_tokens": 2}))  # the stream, read to its end
        return True
    except openai.RateLimitError:
        return False


def test_grpc_messages_are_gated_before_they_are_parsed(router, stub):  # noqa: F811
    """gRPC as HTTP: a wrong key's 11 MB message is refused unparsed; a right key's million
    logit_bias entries are counted in the decode pool, not parsed on the loop."""
    import grpc

    from protos.llm.v1 import generation_pb2 as pb
    from tests.openai_helpers import AUTH

    request = pb.GenerateRequest(prompt="hi")
    for i in range(1_000_000):
        request.sampling.logit_bias[i] = 1.0

    def call(metadata):
        try:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""

    for metadata, code, words in (
        ((("authorization", "Bearer wrong-key"),), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
        (AUTH, grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias: at most 300 entries, got 1000000"),
    ):
        worst = []
        for _ in range(3):  # the least of 3 tries, as above
            late, (got, details) = late_samples_while(router, lambda m=metadata: call(m))
            assert (got, words in details) == (code, True), (got, details)
            worst.append(late)
            if late == 0:
                break
        assert min(worst) == 0, f"{code.name}: loop-lag samples over 50 ms in each try: {worst}"
