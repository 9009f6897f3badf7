"""The slow reference of worker/sampling_ops.py: one row at a time, plain Python floats and
lists, each step written the obvious way (no torch, no vectorization), so that the tensor code has something
independent to be checked against.

Contract
- `reference_adjusted(row, params, prompt, tokens) -> list[float]`: logit bias, repetition,
  frequency and presence penalties (the same step order as worker/sampling_ops.py documents).
- `reference_sampling_logits(adjusted, params) -> list[float]`: temperature, min-p, top-k, top-p;
  dropped tokens are -inf.
- `reference_choice(row, params, prompt, tokens, noise) -> int`: the token the exponential race
  picks for that noise (greedy: the argmax of the adjusted row).
- `reference_top_logprobs(row, n) -> list[(token id, logprob)]`: of the raw logits.
- state: none. Used by tests/test_sampler.py only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from worker.types import SamplingParams

NEG_INF = float("-inf")


def _softmax(row: Sequence[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def reference_adjusted(
    row: Sequence[float], params: SamplingParams, prompt: Sequence[int], tokens: Sequence[int]
) -> list[float]:
    out = list(row)
    for token, bias in params.logit_bias:
        if token < len(out):
            out[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(tokens):
            x = out[token]
            out[token] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    counts = Counter(tokens[len(prompt) :])
    for token, count in counts.items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def reference_sampling_logits(adjusted: Sequence[float], params: SamplingParams) -> list[float]:
    out = [x / params.temperature for x in adjusted]
    if params.min_p > 0:
        probs = _softmax(out)
        floor = params.min_p * max(probs)
        out = [x if p >= floor else NEG_INF for x, p in zip(out, probs)]
    ranked = sorted(range(len(out)), key=lambda t: out[t], reverse=True)
    if params.top_k > 0:
        for token in ranked[params.top_k :]:
            out[token] = NEG_INF
    if params.top_p < 1.0:
        probs = _softmax(out)
        mass = 0.0
        for token in ranked:
            if mass >= params.top_p:
                out[token] = NEG_INF
            mass += probs[token]
    return out


def reference_choice(
    row: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    tokens: Sequence[int],
    noise: Sequence[float],
) -> int:
    adjusted = reference_adjusted(row, params, prompt, tokens)
    if params.greedy:
        return max(range(len(adjusted)), key=lambda t: adjusted[t])
    probs = _softmax(reference_sampling_logits(adjusted, params))
    return max(range(len(probs)), key=lambda t: probs[t] / noise[t])


def reference_top_logprobs(row: Sequence[float], n: int) -> list[tuple[int, float]]:
    top = max(row)
    log_total = top + math.log(sum(math.exp(x - top) for x in row))
    ranked = sorted(range(len(row)), key=lambda t: row[t], reverse=True)[:n]
    return [(t, row[t] - log_total) for t in ranked]
