"""Constrained decoding (structured outputs): each sampled token keeps the output a prefix of a
grammar's language, with llguidance (the token-mask engine vLLM and llama.cpp use).

Contract
- input: `SamplingParams.grammar`, an llguidance grammar (JSON text, as common.structured builds it
  from an OpenAI `response_format`: a JSON Schema, any JSON object, or a regex; the router
  validates it before admission); the model's tokenizer (`tokenizer_json()`, read once, on the
  first constrained request: ~0.2 s for SmolLM2's 49k tokens).
- output: `Grammars.start(request_id, grammar)` (a matcher per request; ValueError naming the
  problem for a grammar this tokenizer cannot run); `allowed(request_ids, vocab)` -> bool
  `[R, vocab]` (CPU) of the tokens each request may take next (EOS only once the grammar is
  complete or the matcher failed: the sequence then ends as at any EOS); `consume(request_id,
  token)` after each sampled token; `release(request_id)`.
- state: one `LLMatcher` per constrained request, advanced only by `consume`, so a preempted and
  recomputed sequence keeps its place in the grammar.
- cost: a mask is ~1 ms of CPU per constrained row per step (SmolLM2's vocabulary, JSON).
- failure modes: ValueError at `start` (bad grammar); a token the mask did not allow (impossible
  through the sampler) leaves the matcher in its error state: EOS only from then on.
- proven by: tests/test_structured_output.py (engine outputs parse and match the schema; the
  masked logits against an unmasked run; through the router and the OpenAI SDK).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.structured import MAX_GRAMMAR_BYTES, available, llguidance


class Grammars:
    """The matchers of a model runner's constrained requests (see the module docstring)."""

    def __init__(self, tokenizer_json: Callable[[], str], eos_token_ids: tuple[int, ...]):
        self._tokenizer_json, self._eos = tokenizer_json, tuple(eos_token_ids)
        self._tokenizer = None
        self.matchers: dict[str, object] = {}

    def _llt(self):
        if self._tokenizer is None:
            if llguidance is None:
                raise ValueError(f"constrained decoding is unavailable: {available()}")
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), eos_token=list(self._eos) or None
            )
        return self._tokenizer

    def start(self, request_id: str, grammar: str) -> None:
        if len(grammar) > 4 * MAX_GRAMMAR_BYTES:  # the compiled form of a schema at the router's limit
            raise ValueError(f"grammar: {len(grammar)} bytes is too large")
        matcher = llguidance.LLMatcher(self._llt(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        self.matchers[request_id] = matcher

    def allowed(self, request_ids: list[str], vocab: int) -> torch.Tensor:
        eos = [t for t in self._eos if t < vocab]
        out = torch.zeros(len(request_ids), vocab, dtype=torch.bool)
        bits = torch.arange(32, dtype=torch.int32)
        for row, request_id in enumerate(request_ids):
            matcher = self.matchers[request_id]
            if matcher.is_error():
                out[row, eos] = True
                continue
            words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            mask = ((words[:, None] >> bits) & 1).flatten().bool()[:vocab]
            out[row, : mask.numel()] = mask
            if matcher.is_stopped():  # complete: only an end of sequence may follow
                out[row] = False
                out[row, eos] = True
        return out

    def consume(self, request_id: str, token: int) -> None:
        matcher = self.matchers.get(request_id)
        if matcher is not None and not matcher.is_stopped():
            matcher.consume_token(token)  # False = error state: EOS only from then on

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
