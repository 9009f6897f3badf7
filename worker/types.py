"""Engine-facing request and output types (pure Python, no torch).

Contract: the engine is token-in / token-out. A request is `prompt_token_ids: list[int]` plus
`SamplingParams`; each `LLMEngine.step()` returns one `RequestOutput` per sequence that produced
tokens or finished in that step. `new_token_ids` are the tokens produced since the last output
(usually one); `new_logprobs` (natural log, float) are parallel to it when requested; with
`top_logprobs` N > 0 each is a `Logprob`, a float that also carries the N most likely tokens there.
With `prompt_logprobs` set, the first output that carries tokens also carries `prompt_logprobs`:
entry i is log P(prompt[i + 1] | prompt[..i]) (a `Logprob` with the N most likely when N > 0).
With `pooling` set (embeddings), the output that carries the one token also carries `embedding`:
the prompt's final hidden states (after the last norm, float32, [hidden_size]) pooled by "last"
(the last prompt token's) or "mean" (over every prompt token), not normalized (worker/pooling.py).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens reached, context full, or the grammar failed mid-way (cut short)
    ABORT = "abort"  # aborted by the caller (cancellation, deadline)


MIN_TEMPERATURE = 1e-5  # smaller temperatures sample greedily (see SamplingParams.__post_init__)
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit; bounds a reply's size)

# Sampling fields that cannot change a greedy argmax; any other field away from its default (a
# penalty, a logit bias, logprobs) sends the batch through the full sampler.
_GREEDY_NEUTRAL = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "stop"}
    | {"prompt_logprobs", "pooling"}  # read off the prompt's rows, not the sampled ones
    | {"adapter"}  # changes the logits, not how they are sampled
)
POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator; same seed -> same tokens
    logprobs: bool = False  # return the logprob of each chosen token
    max_tokens: int = 16  # >= 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from tokens the output already holds
    frequency_penalty: float = 0.0  # [-2, 2]: x how often the output holds the token
    repetition_penalty: float = 1.0  # (0, 2]: divides (>0) or multiplies (<0) seen tokens' logits
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    top_logprobs: int = 0  # also the N most likely tokens at each position (needs logprobs)
    grammar: str = ""  # llguidance grammar the output must follow (worker/grammar.py); "" = none
    # None = off; N >= 0: the logprob of each prompt token after the first, and the N most likely
    # tokens at each position (the prompt is then computed whole: no prefix-cache hit)
    prompt_logprobs: int | None = None
    # "" = off; "last" / "mean": the prompt's pooled hidden state (`RequestOutput.embedding`), with
    # max_tokens 1 (the token is computed and returned, but an embedding caller leaves it out);
    # "mean" computes the prompt whole (no prefix-cache hit)
    pooling: str = ""
    adapter: str = ""  # a LoRA adapter the worker serves (--lora-modules); "" = the base model

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            # logits / temperature would overflow to inf and softmax give NaN (whose argmax was
            # token 0): a temperature this small is greedy, as it is in the limit
            object.__setattr__(self, "temperature", 0.0)
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100) for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ValueError(
                f"top_logprobs must be 0 to {MAX_LOGPROBS} and needs logprobs, got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be 0 to {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if self.pooling and (self.pooling not in POOLINGS or self.max_tokens != 1):
            raise ValueError(
                f"pooling must be one of {', '.join(POOLINGS)} with max_tokens 1, "
                f"got {self.pooling!r} with max_tokens {self.max_tokens}"
            )
        if self.grammar and self.ignore_eos:
            raise ValueError("a grammar ends its output with EOS: it cannot be combined with ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that alters the argmax or asks for logprobs (its batch takes the
        argmax fast path: worker/sampler.py). Computed once per params object: the sampler reads it
        for every row every step."""
        if not self.greedy:
            return False
        for f in dataclasses.fields(self):
            if f.name not in _GREEDY_NEUTRAL and getattr(self, f.name) != f.default:
                return False
        return True

    @property
    def whole_prompt(self) -> bool:
        """Every prompt row is read (prompt logprobs, mean pooling): no prefix-cache hit."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def needs_history(self) -> bool:
        """Penalties read the tokens generated so far (and the prompt, for repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class Logprob(float):
    """A chosen token's logprob (it is that float) plus `top`: the N most likely (token id,
    logprob) pairs at that position, most likely first."""

    __slots__ = ("top",)

    def __new__(cls, value: float, top: tuple[tuple[int, float], ...] = ()):
        obj = super().__new__(cls, value)
        obj.top = top
        return obj


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    queue_s: float = 0.0  # arrival -> first scheduled
    ttft_s: float = 0.0  # arrival -> first output token (0 until then)
    num_preemptions: int = 0  # times this sequence was preempted so far
    prompt_logprobs: list[float] | None = None  # with the first tokens, when asked for (see above)
    embedding: list[float] | None = None  # with the token, when sampling.pooling is set (see above)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One committed engine step (LLMEngine.last_step), for the worker's step histograms."""

    index: int  # LLMEngine.num_steps once it committed (1, 2, ...)
    seconds: float  # its time: launch (or the previous step's end, if later) -> sampled tokens on the host
    tokens: int  # tokens it computed: prompt-chunk tokens + one per decoding sequence
    sequences: int  # sequences in it


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # cumulative
    num_prefix_queries: int  # cumulative prompt tokens looked up in the prefix cache
    num_prefix_hits: int  # cumulative prompt tokens found there
    num_prompt_tokens: int  # cumulative
    num_generation_tokens: int  # cumulative
    num_overlapped_steps: int = 0  # cumulative: planned while the step before ran (async scheduling)
    num_sync_steps: int = 0  # cumulative: planned with no step in flight
    num_grammar_failures: int = 0  # cumulative: constrained generations whose grammar failed mid-way
    num_draft_tokens: int = 0  # cumulative: speculative decoding's drafted tokens, verified
    num_accepted_tokens: int = 0  # cumulative: drafted tokens kept
    num_grammar_over_budget: int = 0  # cumulative: of the grammar failures, masks over the step budget
    num_grammar_compiles: int = 0  # cumulative: grammar texts compiled (the shared cache's misses)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_num_seqs: int = 0  # sequences one step runs at most (0: unknown)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves (--lora-modules)
    info_version: int = 0  # random at start, bumped when `adapters` changes (engine.load_adapter)
