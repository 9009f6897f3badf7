"""The OpenAI-compatible SSE client and the whole CLI (reports, comparison mode) against a tiny fake
`/v1/completions` server on 127.0.0.1 (stdlib http.server; chunked transfer, events split across
writes, CRLF line ends)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.cli import main
from loadtest.grpc_client import SendOptions
from loadtest.openai_client import OpenAIClient, sse_data
from loadtest.record import RequestRecord
from loadtest.runner import Clock
from loadtest.workload import RequestSpec

FIRST_TOKEN_S = 0.03
GAP_S = 0.005


class FakeCompletions(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass  # keep test output free of request lines

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self):
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.received.append(body)
        if body["prompt"] == "please fail":
            return self._send_json(429, {"error": {"message": "slow down"}})
        num_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        threading.Event().wait(FIRST_TOKEN_S)
        for i in range(body["max_tokens"]):
            last = i == body["max_tokens"] - 1
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}
            event = json.dumps({"choices": [choice]})
            data = f"data: {event}\r\n\r\n".encode()
            self._chunk(data[:7])  # an event split across two writes
            self._chunk(data[7:])
            threading.Event().wait(GAP_S)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": body["max_tokens"]}
        self._chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        self._chunk(b"")


@pytest.fixture
def fake_server():
    servers = []

    def start():
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
        server.received = []
        # shutdown() returns once serve_forever next polls: every 0.05 s, not the default 0.5 s
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_sse_parser_keeps_partial_events():
    buffer = bytearray(b'data: {"a": 1}\r\n\r\n: comment\n\ndata: [DO')
    assert sse_data(buffer) == ['{"a": 1}']
    buffer += b"NE]\n\n"
    assert sse_data(buffer) == ["[DONE]"] and buffer == b""


def test_client_records_chunks_usage_and_errors(fake_server):
    server = fake_server()
    clock = Clock()
    client = OpenAIClient(f"http://127.0.0.1:{server.server_port}", SendOptions(), clock.now_ns)

    async def go():
        info = await client.server_info()
        ok, failed = RequestRecord("t", 0, False, 0), RequestRecord("t", 1, False, 0)
        await client.send(RequestSpec("t", 0, "one two three", None, 5, 7), ok, "r0")
        await client.send(RequestSpec("t", 1, "please fail", None, 5, 7), failed, "r1")
        return info, ok, failed

    info, ok, failed = asyncio.run(go())
    assert info["models"] == [{"id": "fake-model"}] and info["model_used"] == "fake-model"
    assert ok.status == "OK" and ok.finish_reason == "length"
    assert (len(ok.chunk_ns), ok.prompt_tokens, ok.completion_tokens, ok.output_tokens) == (5, 3, 5, 5)
    assert FIRST_TOKEN_S <= ok.ttft_s <= ok.e2e_s < 5.0  # the server waits before the first token
    assert len(ok.itl_s) == 4
    sent = server.received[0]
    assert sent["stream"] and sent["max_tokens"] == 5 and sent["ignore_eos"] and sent["model"] == "fake-model"
    assert failed.status == "HTTP_429" and "slow down" in failed.error


def test_connection_refused_is_a_status(fake_server):
    server = fake_server()
    port = server.server_port
    server.shutdown()
    server.server_close()
    clock = Clock()
    client = OpenAIClient(f"http://127.0.0.1:{port}", SendOptions(), clock.now_ns)
    record = RequestRecord("t", 0, False, 0)
    asyncio.run(client.send(RequestSpec("t", 0, "x", None, 2, 0), record, "r"))
    assert record.status == "CONNECTION_ERROR"


def test_cli_writes_reports_and_compares_two_targets(fake_server, tmp_path):
    a, b = fake_server(), fake_server()
    out = tmp_path / "run"
    status = main(
        [
            "--target",
            f"a=http://127.0.0.1:{a.server_port}",
            "--target",
            f"b=http://127.0.0.1:{b.server_port}",
            "--num-requests",
            "6",
            "--rate",
            "20",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--slo",
            "ttft=2s,tpot=1s",
            "--seed",
            "11",
            "--out-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert status == 0
    report = json.loads((out / "report.json").read_text())
    assert report["seed"] == 11 and report["config"]["tenants"][0]["input_len"] == "8"
    assert set(report["targets"]) == {"a", "b"} and report["git"]["commit"]
    for point in report["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"], s["output_tokens"], s["input_tokens"]) == (6, 0, 24, 48)
        assert s["goodput"]["num_good"] == 6
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 12 and {r["target"] for r in requests} == {"a", "b"}
    # the same request stream went to both targets
    assert [r["prompt"] for r in a.received] == [r["prompt"] for r in b.received]
    md = (out / "report.md").read_text()
    assert "## Comparison: b / a" in md and "| TTFT |" in md and "×" in md
    assert (out / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
