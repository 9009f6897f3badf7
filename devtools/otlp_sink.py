"""A minimal OTLP/gRPC trace receiver that keeps spans in memory: the collector end of tests and
benchmarks, and `python -m devtools.otlp_sink [--port 4317]` prints spans while developing.

Contract
- input: OTLP `ExportTraceServiceRequest`s on `opentelemetry.proto.collector.trace.v1.TraceService`.
- output: `spans()` -> flat `SinkSpan`s (service name, ids as hex, parent, times in ns, attributes,
  event names); `wait_for(predicate, timeout_s)` blocks until the spans received satisfy it.
- state: every span received (or only a count, with `keep=False`), and with `keep_raw=True` every
  export request's bytes (`raw()`), behind a condition variable.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class SinkSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict
    events: tuple[str, ...]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: bool = True, keep_raw: bool = False):
        self._keep = keep
        self._keep_raw = keep_raw
        self._raw: list[bytes] = []
        self._spans: list[SinkSpan] = []
        self.num_spans = 0
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"
        self._server.start()

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                spans += [
                    SinkSpan(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(e.name for e in s.events),
                    )
                    for s in ss.spans
                ]
        with self._cond:
            self.num_spans += len(spans)
            if self._keep:
                self._spans += spans
            if self._keep_raw:
                self._raw.append(request.SerializeToString())
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[SinkSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[SinkSpan]], bool], timeout_s: float) -> list[SinkSpan]:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self._spans), timeout_s):
                raise TimeoutError(
                    f"spans received in {timeout_s} s do not satisfy the check: "
                    f"{[(s.service, s.name) for s in self._spans]}"
                )
            return list(self._spans)

    def raw(self) -> bytes:
        """Every export request received, serialized (`keep_raw=True`): a search of these bytes covers
        every attribute, event, status message and resource field, not only what `SinkSpan` parses."""
        with self._cond:
            return b"".join(self._raw)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def stop(self) -> None:
        self._server.stop(grace=None)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m devtools.otlp_sink", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4317)
    a = p.parse_args()
    sink = OtlpSink(a.host, a.port)
    print(f"OTLP/gRPC receiver on {sink.endpoint}; Ctrl-C stops", flush=True)
    seen = 0
    try:
        while True:
            spans = sink.wait_for(lambda s: len(s) > seen, timeout_s=3600)
            for s in spans[seen:]:
                print(
                    f"{s.trace_id} {s.span_id} <- {s.parent_span_id or '-':16} {s.service:12} {s.name:28} "
                    f"{(s.end_ns - s.start_ns) / 1e6:9.1f} ms {s.events or ''}",
                    flush=True,
                )
            seen = len(spans)
    except (KeyboardInterrupt, TimeoutError):
        sink.stop()


if __name__ == "__main__":
    main()
