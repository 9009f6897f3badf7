"""The `llm.v1.Generation` servicer: protobuf in, one call per stage, protobuf out.

Contract
- input: `GenerateRequest` + call metadata (API key) + deadline; `ListModelsRequest`.
- output: a stream of `GenerateResponse` (chunks, then `Finished`); `ListModelsResponse`.
- state: none of its own (drain counter, registry and tenants are injected).
- failure modes: raises `router.errors` exceptions; `ErrorInterceptor` turns them into statuses.
  Stage order: drain check -> auth -> validate -> tokenize -> fit to context -> relay.
- proven by: tests/test_grpc_e2e.py, tests/test_grpc_validation.py.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import jinja2

from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.config import Limits
from router.drain import Drain
from router.errors import Unavailable, ValidationError
from router.registry import WorkerRegistry
from router.relay import Chunk, Done, Relay
from router.tenants import Tenants
from router.validation import ValidRequest, fit_to_context, validate

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}


def _to_pb(event: Chunk | Done) -> pb.GenerateResponse:
    if isinstance(event, Chunk):
        return pb.GenerateResponse(chunk=pb.TokenChunk(
            token_ids=event.token_ids, text=event.text, logprobs=event.logprobs))
    return pb.GenerateResponse(finished=pb.Finished(
        reason=FINISH_REASONS[event.reason], request_id=event.request_id,
        usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                       cached_prompt_tokens=event.cached_prompt_tokens),
        timing=pb.Timing(queue_ms=event.queue_ms, ttft_ms=event.ttft_ms, total_ms=event.total_ms)))


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, registry: WorkerRegistry, tokenizer: Tokenizer, tenants: Tenants,
                 limits: Limits, drain: Drain):
        self._registry = registry
        self._tokenizer = tokenizer
        self._tenants = tenants
        self._limits = limits
        self._drain = drain
        self._relay = Relay(registry, tokenizer)

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival_s = time.monotonic()
        self._drain.enter()
        try:
            tenant = self._tenants.authenticate(context.invocation_metadata() or (), context.peer())
            models = self._registry.models()
            if not models:
                raise Unavailable("no healthy worker is connected to this router")
            req = validate(request, self._limits, models)
            prompt_ids = await asyncio.to_thread(self._tokenize, req)
            max_tokens = fit_to_context(req, len(prompt_ids), self._limits)
            remaining = context.time_remaining()
            deadline_s = None if remaining is None else arrival_s + remaining
            events = self._relay.run(req, prompt_ids, max_tokens, tenant, arrival_s, deadline_s)
            async with aclosing(events):  # closing the call closes the worker stream at once
                async for event in events:
                    yield _to_pb(event)
        finally:
            self._drain.exit()

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        self._drain.enter()
        try:
            self._tenants.authenticate(context.invocation_metadata() or (), context.peer())
            cards = []
            for name, spec in sorted(self._registry.models().items()):
                cards.append(pb.ModelCard(id=name, max_model_len=spec.max_model_len,
                                          num_workers=len(self._registry.healthy(name))))
            return pb.ListModelsResponse(models=cards)
        finally:
            self._drain.exit()

    def _tokenize(self, req: ValidRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.chat is not None:
            try:
                return self._tokenizer.encode_chat(list(req.chat))
            except (ValueError, jinja2.TemplateError) as exc:  # the template refused these messages
                raise ValidationError("chat.messages", str(exc)) from None
        return self._tokenizer.encode(req.prompt)
