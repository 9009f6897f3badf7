"""Client for our gRPC API (`llm.v1.Generation`): one grpc.aio channel, one stream per request.

Contract
- `GrpcClient(address, options)` (TLS when `options.tls_ca` names a CA file);
  `await send(spec, record, request_id, api_key, priority)` runs one `Generate` call and fills
  `record` (see `loadtest.record`): sent time just before the call, each `TokenChunk` with token ids
  as it arrives, the `Finished` message's usage, reason and queue time; failures become the gRPC
  status name. It never raises for a failed request.
- `await server_info(api_key)`: the served models (`ListModels`) for the report.
- Prompts go as text (the router tokenizes, as a real client's would) or, with
  `prompt_format="tokens"`, as token ids when the workload knows them. Output length is fixed by
  `max_tokens` + `ignore_eos` when the run asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.tls import channel_credentials
from loadtest.record import RequestRecord
from loadtest.workload import RequestSpec
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc

REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class SendOptions:
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    prompt_format: str = "text"  # text | tokens
    timeout_s: float = 300.0
    tls_ca: str = ""  # PEM CA to verify the server with; "" = plaintext


class GrpcClient:
    api = "grpc"

    def __init__(self, address: str, options: SendOptions, clock_ns: Callable[[], int]):
        self._options = options
        self._clock_ns = clock_ns
        channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if options.tls_ca:
            self._channel = grpc.aio.secure_channel(
                address, channel_credentials(options.tls_ca), options=channel_options
            )
        else:
            self._channel = grpc.aio.insecure_channel(address, options=channel_options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def build_request(self, spec: RequestSpec, request_id: str, priority: int) -> pb.GenerateRequest:
        o = self._options
        req = pb.GenerateRequest(request_id=request_id, model=o.model, priority=priority)
        if o.prompt_format == "tokens" and spec.prompt_ids is not None:
            req.token_ids.ids.extend(spec.prompt_ids)
        else:
            req.prompt = spec.prompt
        req.sampling.temperature = o.temperature
        req.sampling.seed = spec.seed
        req.stopping.max_tokens = spec.max_tokens
        req.stopping.ignore_eos = o.ignore_eos
        return req

    async def send(
        self, spec: RequestSpec, record: RequestRecord, request_id: str, api_key: str = "", priority: int = 0
    ) -> None:
        request = self.build_request(spec, request_id, priority)
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        record.sent_ns = self._clock_ns()
        try:
            call = self._stub.Generate(request, metadata=metadata, timeout=self._options.timeout_s)
            async for msg in call:
                now = self._clock_ns()
                if msg.HasField("chunk"):
                    if msg.chunk.token_ids:
                        record.chunk_ns.append(now)
                        record.chunk_tokens.append(len(msg.chunk.token_ids))
                else:
                    f = msg.finished
                    record.prompt_tokens = f.usage.prompt_tokens
                    record.completion_tokens = f.usage.completion_tokens
                    record.cached_prompt_tokens = f.usage.cached_prompt_tokens
                    record.finish_reason = REASONS.get(f.reason, "unspecified")
                    record.server_queue_ms = f.timing.queue_ms
            record.end_ns = self._clock_ns()
            if not record.finish_reason:
                record.status, record.error = "INCOMPLETE", "stream ended without a Finished message"
        except grpc.aio.AioRpcError as exc:
            record.end_ns = self._clock_ns()
            record.status, record.error = exc.code().name, exc.details() or ""

    async def server_info(self, api_key: str = "") -> dict:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        try:
            reply = await self._stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            return {"api": "grpc", "error": f"{exc.code().name}: {exc.details()}"}
        models = [
            {"id": m.id, "max_model_len": m.max_model_len, "num_workers": m.num_workers} for m in reply.models
        ]
        return {"api": "grpc", "models": models}

    async def close(self) -> None:
        await self._channel.close()
