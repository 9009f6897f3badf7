"""What the client saw of one request: the raw clock readings and counts, and the per-request
metrics of docs/metrics.md derived from them.

Contract
- A client fills a `RequestRecord`: `sent_ns` just before the call is issued, one entry in
  `chunk_ns` / `chunk_tokens` per token-carrying chunk as it arrives, `end_ns` at the final
  message (or the error), `status` ("OK" or the gRPC status name / `HTTP_<code>` /
  `CONNECTION_ERROR` / `CLIENT_DRAIN_TIMEOUT`), and the server's own figures when it sends them
  (`prompt_tokens`, `completion_tokens`, `cached_prompt_tokens`, `server_queue_ms`).
- Times are `time.perf_counter_ns()` minus the run's start, so every record of a run shares a
  clock. Derived properties are in seconds and None where undefined: TTFT needs one token-carrying
  chunk, TPOT needs more than one output token.
- `output_tokens`: the server's completion count when it sent one (OpenAI streams do not say how
  many tokens each chunk holds), else the client's own count of token ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

NS_PER_S = 1e9


@dataclass
class RequestRecord:
    tenant: str
    index: int
    warmup: bool
    scheduled_ns: int  # when the arrival process wanted it sent (open loop)
    sent_ns: int = 0
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    status: str = "OK"
    error: str = ""
    input_len: int | None = None  # the client's token count of the prompt, when known
    prompt_tokens: int | None = None  # server usage
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    finish_reason: str = ""
    server_queue_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def client_wait_s(self) -> float:
        """Time spent waiting for a client concurrency slot (open loop with a cap)."""
        return max(0, self.sent_ns - self.scheduled_ns) / NS_PER_S

    @property
    def num_client_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.num_client_tokens

    @property
    def input_tokens(self) -> int:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return self.input_len or 0

    @property
    def ttft_s(self) -> float | None:
        return (self.chunk_ns[0] - self.sent_ns) / NS_PER_S if self.chunk_ns else None

    @property
    def e2e_s(self) -> float:
        return (self.end_ns - self.sent_ns) / NS_PER_S

    @property
    def itl_s(self) -> list[float]:
        return [(b - a) / NS_PER_S for a, b in zip(self.chunk_ns, self.chunk_ns[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return asdict(self)
