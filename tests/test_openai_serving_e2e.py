"""The OpenAI-compatible HTTP front's serving life, end to end with real router and worker
processes and the official `openai` SDK: no worker -> 503; SIGTERM lets an open HTTP stream finish;
a router with a TLS certificate serves the API over HTTPS; GET /health follows the gRPC health
(503 with no worker and while draining, 200 serving, over HTTPS too); a request that waits in the router's
fair queue (the worker's KV capacity reserved by a running stream) and whose client leaves is
taken out of the queue, and nothing stays behind (queue, open calls, KV blocks). The API itself:
tests/test_openai_e2e.py.
"""

from __future__ import annotations

import json
import pathlib
import signal
import time
import urllib.error

import grpc
import openai
import pytest

from tests import procs
from tests.openai_helpers import http_url, post, post_and_leave, self_signed, tcp_sockets

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village at the edge of a great forest, there lived"


def health(url: str, context=None) -> tuple[int, dict]:
    """GET /health (the base URL without /v1), no API key: (status, body)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker (tests/conftest.py): default engine flags, float32."""
    return plain_worker


def test_no_worker_is_503(logs):
    dead = f"127.0.0.1:{procs.free_port()}"
    proc = procs.start_router(logs, [dead], "--http-port", "0")
    try:
        with openai.OpenAI(base_url=http_url(proc), api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.chat.completions.create(model="", messages=FRANCE, max_tokens=2)
        assert info.value.status_code == 503
        assert health(http_url(proc)) == (503, {"status": "NOT_SERVING"})  # no healthy worker
    finally:
        proc.stop()


def test_sigterm_lets_open_http_streams_finish(worker, logs):
    proc = procs.start_router(logs, [worker.address], "--http-port", "0", "--drain-grace-s", "60")
    try:
        procs.ready(proc)
        with openai.OpenAI(base_url=http_url(proc), api_key="unused", max_retries=0, timeout=120) as c:
            stream = c.completions.create(
                model="",
                prompt=STORY,
                max_tokens=10,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = iter(stream)
            next(chunks)  # the request is in flight
            assert health(http_url(proc)) == (200, {"status": "SERVING"})
            proc.signal(signal.SIGTERM)
            procs.wait_until(lambda: health(http_url(proc))[0] == 503, 30, "/health 503 while draining")
            rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert proc.popen.wait(60) == 0
        assert "router stopped" in proc.log_tail()
    finally:
        proc.stop()


def test_tls_router_serves_the_http_api_over_https(worker, logs, tmp_path):
    import ssl

    cert, key = self_signed(tmp_path)
    proc = procs.start_router(
        logs, [worker.address], "--http-port", "0", "--tls-cert", cert, "--tls-key", key
    )
    try:
        procs.ready(proc, credentials=grpc.ssl_channel_credentials(pathlib.Path(cert).read_bytes()))
        url = http_url(proc)
        assert url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=cert)
        with openai.OpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=openai.DefaultHttpxClient(verify=trust)
        ) as c:
            assert c.completions.create(model="", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert health(url, context=trust)[0] == 200  # an HTTPS probe, where kubelet's gRPC one cannot go
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the TLS port
            post(url.replace("https://", "http://") + "/completions", b"{}", "", timeout_s=10)
    finally:
        proc.stop()


def test_a_client_gone_while_queued_leaves_nothing_behind(worker, logs):
    """With the worker's KV capacity reserved by a running stream (the router places a request only
    where its prompt + max_tokens fit: router/dispatcher.py), a request waits in the router's fair
    queue before any status line is sent; its client leaving takes it out of the queue and
    releases its ticket."""

    def router_state(proc) -> dict[str, float]:
        return {
            name: v
            for (name, labels), v in procs.scrape(proc).items()
            if not labels or name.startswith("llm_req")
        }

    def wait_for(proc, ok, what: str) -> dict[str, float]:
        deadline = time.monotonic() + 30
        while not ok(state := router_state(proc)):
            if time.monotonic() > deadline:  # rare in full suites: what each side saw, for the cause
                raise AssertionError(
                    f"router never reached {what}: {state}\nsockets:\n{tcp_sockets(url)}\n"
                    f"router log:\n{proc.log_tail()}"
                )
            time.sleep(0.05)
        return state

    with procs.running_router(logs, [worker.address], "--http-port", "0", "--metrics-port", "0") as proc:
        url = http_url(proc)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
            [model] = c.models.list().data
            context = model.model_extra["max_model_len"]  # the worker's KV capacity, in tokens
            stream = c.completions.create(
                model="",
                prompt=STORY,
                max_tokens=context - 64,  # with the prompt, all but a few tokens of the capacity
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(iter(stream))  # it runs, holding its reservation
            started = post_and_leave(  # needs more room than is left: it waits in the queue
                f"{url}/completions",
                json.dumps({"prompt": "queued", "max_tokens": 100}).encode(),
                "",
                lambda: router_state(proc).get("llm_router_queue_length") == 1,
                "the request queued",
            )
            assert not started  # queued: no status line yet when its client left
            state = wait_for(proc, lambda s: s.get("llm_router_queue_length") == 0, "an empty queue")
            assert state["llm_router_open_calls"] == 1  # only the running stream
            stream.close()
        wait_for(proc, lambda s: s.get("llm_router_open_calls") == 0, "no open call")
        procs.wait_all_blocks_free(worker.address)
        admitted = procs.scrape(proc)[("llm_admitted_requests_total", (("tenant", "default"),))]
        assert admitted == 2  # the queued request was admitted, then left
