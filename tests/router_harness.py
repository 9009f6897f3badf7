"""An in-process router for race tests: the real GenerationService, StaticRegistry, FairQueue,
AdmissionController and Dispatcher over scripted gRPC workers served on 127.0.0.1 in the same event
loop (real gRPC calls, so cancellations and stream ends are the real ones).

- `ScriptedWorker`: `behavior(request)` -> steps ("tok", n) / ("sleep", s) / ("abort", code) /
  ("finish",); counts its `calls`.
- `Router.create(workers, ...)`, `generate(request)` -> (responses, error), `state()` (every piece
  of accounting, all zero when idle), `close()`.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import worker_pb2 as wpb
from protos.llm.v1 import worker_pb2_grpc
from router.admission import AdmissionConfig, AdmissionController
from router.config import Limits
from router.dispatcher import Dispatcher
from router.drain import Drain
from router.fair_queue import FairQueue
from router.models import ModelTable
from router.registry import StaticRegistry
from router.service import GenerationService
from router.tenants import Tenant, Tenants

MODELS = ModelTable.from_entries(())
MODEL = MODELS.ids()[0]


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """behavior(request) -> list of steps: ("tok", n) / ("sleep", s) / ("abort", code) / ("finish",)"""

    def __init__(self, blocks=64, block_size=16, max_num_seqs=8, max_model_len=1024):
        fp = MODELS.get(MODEL).fingerprint
        self.info = wpb.WorkerInfo(
            model=MODEL,
            block_size=block_size,
            max_model_len=max_model_len,
            vocab_size=fp.vocab_size,
            eos_token_ids=fp.eos_token_ids,
            max_num_seqs=max_num_seqs,
        )
        self.info.tokenizer.CopyFrom(
            wpb.TokenizerFingerprint(
                vocab_size=fp.vocab_size, eos_token_ids=fp.eos_token_ids, vocab_sha256=fp.vocab_sha256
            )
        )
        self.blocks = blocks
        self.behavior = lambda req: [("tok", 1)] * 4 + [("finish",)]
        self.calls = 0
        self.open = 0

    async def Generate(self, request, context):
        self.calls += 1
        self.open += 1
        try:
            for step in self.behavior(request):
                if step[0] == "tok":
                    yield wpb.WorkerResponse(token_ids=[100] * step[1], logprobs=[-0.1] * step[1])
                elif step[0] == "sleep":
                    await asyncio.sleep(step[1])
                elif step[0] == "abort":
                    await context.abort(step[1], "injected")
                elif step[0] == "finish":
                    yield wpb.WorkerResponse(
                        finished=wpb.WorkerFinished(reason=wpb.WORKER_FINISH_REASON_LENGTH)
                    )
                    return
        finally:
            self.open -= 1

    async def GetLoad(self, request, context):
        return wpb.LoadReport(num_free_blocks=self.blocks, num_total_blocks=self.blocks)

    async def GetInfo(self, request, context):
        return self.info


async def start_worker(w: ScriptedWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(w, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


class Ctx:
    def __init__(self, timeout=None):
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self):
        return "ipv4:127.0.0.1:1"


class TenantsHolder:
    def __init__(self, tenant: Tenant):
        self.current = Tenants([tenant], require_key=False, allow_public=True)


class Router:
    @classmethod
    async def create(cls, workers, tenant=None, queue_requests=True, poll_s=0.2, **limits):
        self = cls()
        self.servers, addrs = [], []
        for w in workers:
            s, a = await start_worker(w)
            self.servers.append(s)
            addrs.append(a)
        self.addrs = addrs
        self.registry = StaticRegistry(tuple(addrs), poll_s=poll_s, check_info=MODELS.check)
        MODELS.live = self.registry.models
        MODELS.claimed = self.registry.adapter_bases
        await self.registry.start()
        self.queue = FairQueue()
        self.admission = AdmissionController(self.queue, AdmissionConfig())
        self.dispatcher = Dispatcher(self.queue, self.registry, recheck_s=0.2, no_worker_grace_s=0.5)
        self.drain = Drain()
        self.tenant = tenant or Tenant("t", max_priority=10)
        self.service = GenerationService(
            self.registry,
            MODELS,
            TenantsHolder(self.tenant),
            Limits(**limits),
            self.drain,
            self.admission,
            self.dispatcher,
            queue_requests=queue_requests,
        )
        self.dispatcher.start()
        return self

    def handles(self) -> list:
        """The registry's worker handles, in the order the workers were given to `create`."""
        return sorted(self.registry.all(), key=lambda h: self.addrs.index(h.address))

    def state(self):
        hs = self.registry.all()
        return {
            "open": self.admission.open_requests(),
            "tokens_in_flight": self.admission.tokens_in_flight,
            "queued": len(self.queue),
            "reserved": {a: dict(c) for a, c in self.dispatcher._reserved.items() if c},
            "outstanding": {h.address: (h.outstanding_tokens, h.num_inflight) for h in hs},
            "drain": self.drain.num_inflight,
            "streams": {h.address: len(h.streams) for h in hs if h.streams},
        }

    async def generate(self, req: pb.GenerateRequest, timeout=None, limit=None):
        out, err = [], None
        gen = self.service.Generate(req, Ctx(timeout))
        try:
            async for r in gen:
                out.append(r)
                if limit is not None and len(out) >= limit:
                    break
        except Exception as exc:  # noqa: BLE001
            err = exc
        finally:
            await gen.aclose()
        return out, err

    async def close(self):
        await self.dispatcher.stop()
        await self.registry.stop()
        for s in self.servers:
            await s.stop(0)


def request(ids=(1, 2, 3, 4), max_tokens=4, **kw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(**kw)
    r.token_ids.ids.extend(ids)
    r.stopping.max_tokens = max_tokens
    r.stopping.ignore_eos = True
    return r


def tokens(out):
    return [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids]
