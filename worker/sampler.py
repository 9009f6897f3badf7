"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprobs.

Contract: `sample(logits [S, V] float32, params, generators) -> (token_ids [S], logprobs [S] | None)`.
Rows with temperature 0 (or top_k 1) take the argmax. Others sample from softmax(logits / T)
restricted to the top-k tokens and then to the smallest set whose probability reaches top_p, by
the exponential race (argmax p / E, E ~ Exp(1)), which draws exactly from p. Each row has its own
`torch.Generator` (seeded from the request's seed, or from the engine's seeded generator), so the
same seed gives the same tokens whatever else is in the batch. Logprobs are log-softmax of the raw
logits (before temperature and truncation), as vLLM reports them.
Proven by tests/test_sampler.py (reproducibility and distribution tests).
"""

from __future__ import annotations

import torch

from worker.types import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's top-k and top-p sets. top_k 0 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Keep a token when the mass before it is still below top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float] | None]:
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = (
            logits[idx]
            / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
        )
        needs_trunc = any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows)
        if needs_trunc:
            top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
            sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(random_rows):
            noise[row].exponential_(generator=generators[i])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    token_list = tokens.tolist()
    if not any(p.logprobs for p in params):
        return token_list, None
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return token_list, logprobs.tolist()
