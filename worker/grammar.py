"""Constrained decoding (structured outputs): each sampled token keeps the output a prefix of a
grammar's language, with llguidance (the token-mask engine vLLM and llama.cpp use).

Contract
- input: `SamplingParams.grammar`, an llguidance grammar (JSON text, as common.structured builds
  it from a `response_format`: a JSON Schema, any JSON object, or a regex; the router validates it
  before admission); the model's tokenizer (`tokenizer_json()`, read once, on the first
  constrained request: ~0.2 s for SmolLM2's 49k tokens, on the engine thread).
- output: `Grammars.matcher(grammar)` -> a new llguidance matcher (the engine keeps it on the
  request's `Sequence`; ValueError naming the problem for a grammar this tokenizer cannot run, or
  where llguidance is not installed); `allowed(matchers, vocab)` -> bool `[R, vocab]` (CPU) of the
  tokens each may take next (EOS only once the grammar is complete or the matcher failed: the
  sequence then ends as at any EOS); for a sampling step, `banned(seqs, vocab, device)` -> the
  bool `[S, vocab]` the sampler sets to -inf, then `advance(seqs, tokens)` (`consume(matcher,
  token)` for each constrained row).
- state: the llguidance tokenizer; each matcher lives on its `Sequence` (advanced only by
  `consume`, so a preempted and recomputed sequence keeps its place in the grammar, and nothing
  keyed by request id can outlive or be shared by a request).
- cost: +0.3 ms per step at batch 1, +0.085 ms per row at batch 32 (docs/benchmarks.md).
- failure modes: ValueError from `matcher` (bad grammar, llguidance missing); RuntimeError when
  the model's tokenizer cannot be read (a worker fault: INTERNAL, remembered, not retried per
  request). A matcher can enter
  llguidance's error state mid-generation (a resource limit, e.g. the regex `(a{1000}){1000}`:
  "too many expressions constructed"; a token it did not allow cannot come through the sampler):
  the error is logged and counted (`num_failures`), the sequence is marked (`grammar_failed`) and
  only EOS is allowed from then on, so the output ends at once, incomplete, with finish reason
  LENGTH (worker/scheduler.py `_stop_reason`), never STOP: the client sees an answer cut short.
- proven by: tests/test_structured_output.py (engine outputs accepted whole by a fresh matcher and
  parsed against the schema; the unpacked mask against llguidance's byte mask; async scheduling,
  preemption and aborts; through the router and the OpenAI SDK); tests/test_grammar_failure.py (a
  grammar failing mid-way ends LENGTH and is counted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from common.structured import MAX_COMPILED_GRAMMAR_BYTES, llguidance

log = logging.getLogger(__name__)


class Grammars:
    """A model runner's llguidance tokenizer and the matchers made from it."""

    def __init__(self, tokenizer_json: Callable[[], str], eos_token_ids: tuple[int, ...]):
        """`tokenizer_json()`: the model's `tokenizers` JSON, read on the first constrained request
        (`for_model` reads it from a --model value)."""
        self._tokenizer_json, self._eos = tokenizer_json, tuple(eos_token_ids)
        self._tokenizer = None
        self._failed: str | None = None  # why the tokenizer could not be built (not retried)
        self.num_failures = 0  # cumulative: matchers that failed mid-generation (EngineStats)

    @classmethod
    def for_model(cls, model: str | None, eos_token_ids: tuple[int, ...]) -> Grammars:
        """Grammars over the tokenizer of a --model value (None = the embedded model)."""

        def tokenizer_json() -> str:
            from common.model_files import resolve_model_source
            from common.tokenizer import Tokenizer

            return Tokenizer.from_model(resolve_model_source(model)).backend_json()

        return cls(tokenizer_json, eos_token_ids)

    def _llt(self):
        if self._tokenizer is None:
            if self._failed:
                raise RuntimeError(self._failed)
            try:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), eos_token=list(self._eos) or None
                )
            except Exception as exc:  # a worker fault, not the request's: INTERNAL (the router retries)
                log.exception("structured output: the model's tokenizer could not be read")
                self._failed = (
                    f"structured output: the model's tokenizer could not be read ({type(exc).__name__})"
                )
                raise RuntimeError(self._failed) from None
        return self._tokenizer

    def matcher(self, grammar: str):
        if llguidance is None:
            raise ValueError(
                "structured output is unavailable on this worker: the llguidance package is not installed"
            )
        if len(grammar) > MAX_COMPILED_GRAMMAR_BYTES:  # the router's bound too (common/structured.py)
            raise ValueError(f"grammar: {len(grammar)} bytes is too large")
        matcher = llguidance.LLMatcher(self._llt(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return matcher

    def allowed(self, matchers: list, vocab: int) -> torch.Tensor:
        """bool [R, vocab]: each matcher's bitmask written straight into one buffer, unpacked in one
        lookup (little-endian words: token t is bit t % 8 of byte t // 8)."""
        eos = [t for t in self._eos if t < vocab]
        words = (self._llt().vocab_size + 31) // 32
        packed = np.zeros((len(matchers), words * 4), dtype=np.uint8)
        ended = []
        for row, matcher in enumerate(matchers):
            if matcher.is_error() or matcher.is_stopped():  # failed, or complete: only EOS may follow
                ended.append(row)
            else:
                matcher.unsafe_compute_mask_ptr(packed[row].ctypes.data, words * 4)
        bits = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little"))  # [R, words * 32]
        out = torch.zeros(len(matchers), vocab, dtype=torch.bool)
        n = min(vocab, bits.shape[1])
        out[:, :n] = bits[:, :n]
        if ended:
            out[ended] = False
            for row in ended:
                out[row, eos] = True
        return out

    def banned(self, seqs: list, vocab: int, device: torch.device) -> torch.Tensor | None:
        """bool [S, vocab] on `device`: the tokens the grammar of each row's sequence (`.matcher`)
        does not allow, nothing for rows without one; None when no row has one."""
        rows = [i for i, seq in enumerate(seqs) if getattr(seq, "matcher", None) is not None]
        if not rows:
            return None
        out = torch.zeros(len(seqs), vocab, dtype=torch.bool)
        out[rows] = ~self.allowed([seqs[i].matcher for i in rows], vocab)
        return out.to(device)

    def advance(self, seqs: list, tokens: torch.Tensor) -> None:
        """Each constrained row's matcher takes its sampled token (one host copy of `tokens`). A
        sequence whose matcher failed is marked `grammar_failed` (its EOS then ends it LENGTH, not
        STOP) and counted once."""
        for seq, token in zip(seqs, tokens.tolist()):
            matcher = getattr(seq, "matcher", None)
            if matcher is None or self.consume(matcher, token) or getattr(seq, "grammar_failed", False):
                continue
            seq.grammar_failed = True
            self.num_failures += 1
            log.warning(
                "structured output: the grammar failed at token %d (%s); ending with EOS (finish: length)",
                token,
                matcher.get_error(),
            )

    def consume(self, matcher, token: int) -> bool:
        """`matcher` takes `token`; False once it has failed (llguidance's error state, reached on
        this token or while computing its mask: a failed matcher also reports itself stopped)."""
        if not matcher.is_stopped() and not matcher.consume_token(token):
            return False
        return not matcher.is_error()
