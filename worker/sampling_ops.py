"""Token sampling's batched ops: greedy, temperature, min-p, top-k, top-p, penalties, logit bias,
per-row generators, chosen-token and top-N logprobs (the per-request state that feeds them is
worker/sampler.py's `RequestSampler`).

Contract: `sample(logits [S, V] float32, params, generators, histories) -> (token_ids [S],
logprobs [S] | None)` (`sample_tokens`: the same with the tokens left on the device as `[S]`
int64, wrapped by the model runner in a `SampledTokens`); `histories[i]` = (prompt token ids,
prompt + output token ids so far) of row i, needed only by rows with penalties
(`SamplingParams.needs_history`).
Order of the steps, as vLLM applies them:
1. `adjust_logits`: logit bias added; repetition penalty over prompt + output tokens (a positive
   logit divided by it, a negative one multiplied); frequency penalty x count and presence penalty
   (once) subtracted for the tokens of the output so far. Then rows with a grammar (structured
   output, worker/grammar.py) set every token it does not allow to -inf. Greedy rows take the
   argmax here.
2. `sampling_logits` (other rows): / temperature, then min-p (drop tokens with probability below
   min_p x the largest), then top-k, then top-p (the smallest set whose mass reaches top_p); the
   tensor math is worker/kernels/reference.py's, which the fused kernel's reference shares.
3. Draw by the exponential race (argmax p / E, E ~ Exp(1)), which draws exactly from p. Each row
   has its own `torch.Generator` (the request's seed, or one from the engine's seeded generator),
   so the same seed gives the same tokens whatever else is in the batch.
Logprobs are log-softmax of the raw logits (before bias, penalties, temperature and truncation), as
vLLM reports them; with `top_logprobs` N each is a `worker.types.Logprob` carrying the N most
likely tokens.
Also the model runner's helpers around sampling: `take_rows` (the sampling rows of the hidden
states) and `fused_sampler` (the Triton kernel on CUDA).
Proven by tests/test_sampler.py: reproducibility and distribution tests, and every step against
the pure-Python reference in worker/sampler_reference.py (logits, drawn tokens, top-N logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.kernels import reference
from worker.types import Logprob, SamplingParams

log = logging.getLogger(__name__)

History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, prompt + output ids)


def on_device(values: list, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA through pinned memory with a non-blocking copy:
    `torch.tensor(values, device="cuda")` copies from pageable memory and synchronizes the stream,
    which would make the host wait for the step in flight."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _flat(rows: list[int], token_lists: list[Sequence[int]], vocab: int, dev) -> torch.Tensor:
    """Positions `row * vocab + token` of every listed token below `vocab` in a flattened [R, V]."""
    flat = [k * vocab + t for k, tokens in zip(rows, token_lists) for t in tokens if t < vocab]
    return on_device(flat, dev, torch.long)


def penalty_state(histories: Sequence[History], vocab: int, device) -> torch.Tensor:
    """The token statistics penalties read, `[R, 2, V]` float32: `[:, 0]` counts each token of the
    output so far (frequency, presence), `[:, 1]` is 1 for every token of prompt or output
    (repetition). The model runner keeps one row per penalized request on the device, built from
    its prompt at its first sampling step and updated by `record_tokens` with each sampled token,
    so a step never reads the token history on the host (async scheduling overlaps it)."""
    state = torch.zeros(len(histories) * 2 * vocab, dtype=torch.float32, device=device)
    rows = range(len(histories))
    outputs = [tokens[len(prompt) :] for prompt, tokens in histories]
    state.index_fill_(0, _flat([2 * k + 1 for k in rows], [h[1] for h in histories], vocab, device), 1.0)
    flat = _flat([2 * k for k in rows], outputs, vocab, device)
    state.index_add_(0, flat, torch.ones(len(flat), dtype=torch.float32, device=device))
    return state.view(len(histories), 2, vocab)


def record_tokens(states: list[torch.Tensor], tokens: torch.Tensor) -> None:
    """Count `tokens[k]` (on the device, no host sync) into `states[k]` (a `[2, V]` row)."""
    one = torch.ones(1, dtype=torch.float32, device=tokens.device)
    for k, state in enumerate(states):
        token = tokens[k : k + 1]
        state[0].index_add_(0, token, one)
        state[1].index_fill_(0, token, 1.0)


def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: Sequence[History] | None,
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logit bias and penalties (a copy when any row has them; else `logits` itself). A few batched
    ops whatever the number of rows: a launch-bound GPU step does not pay per row. Penalties read
    `state` (`penalty_state`'s `[P, 2, V]`, one row per penalized row in order) if given, else
    the rows' `histories`."""
    if not any(p.logit_bias or p.needs_history for p in params):
        return logits
    out = logits.clone()
    vocab, dev, dtype = logits.shape[-1], logits.device, logits.dtype
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        ids = [[t for t, _ in params[i].logit_bias] for i in biased]
        vals = [b for i in biased for t, b in params[i].logit_bias if t < vocab]
        out.view(-1).index_add_(0, _flat(biased, ids, vocab, dev), on_device(vals, dev, dtype))
    penalized = [i for i, p in enumerate(params) if p.needs_history]
    if not penalized:
        return out
    if state is None:
        if histories is None:
            raise ValueError("penalties need each row's token history")
        state = penalty_state([histories[i] for i in penalized], vocab, dev)
    repeat = [k for k, i in enumerate(penalized) if params[i].repetition_penalty != 1.0]
    if repeat:  # over prompt and output tokens: positive logits divided, negative multiplied
        seen = state.index_select(0, on_device(repeat, dev, torch.int64))[:, 1] > 0
        rows = [penalized[k] for k in repeat]
        r = on_device([params[i].repetition_penalty for i in rows], dev, dtype)[:, None]
        idx = on_device(rows, dev, torch.int64)
        sub = out[idx]
        factor = torch.where(sub > 0, 1.0 / r, r)  # x / r == x * (1 / r) up to rounding
        out[idx] = torch.where(seen, sub * factor, sub)
    counted = [
        k for k, i in enumerate(penalized) if params[i].frequency_penalty or params[i].presence_penalty
    ]
    if counted:  # over the output so far: frequency x count, presence once
        counts = state.index_select(0, on_device(counted, dev, torch.int64))[:, 0].to(dtype)
        rows = [penalized[k] for k in counted]
        freq = on_device([params[i].frequency_penalty for i in rows], dev, dtype)
        pres = on_device([params[i].presence_penalty for i in rows], dev, dtype)
        idx = on_device(rows, dev, torch.int64)
        out[idx] -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(dtype)
    return out


def sampling_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits the random draw uses for these (non-greedy) rows: temperature, min-p, top-k, top-p
    (`worker.kernels.reference.sampling_logits`, the steps no row uses left out)."""
    dev = logits.device
    temperature = on_device([p.temperature for p in params], dev)
    min_p = on_device([p.min_p for p in params], dev) if any(p.min_p > 0 for p in params) else None
    top_k = top_p = None
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = on_device([p.top_k for p in params], dev)
        top_p = on_device([p.top_p for p in params], dev)
    return reference.sampling_logits(logits, temperature, min_p, top_k, top_p)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[History] | None = None,
    state: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    states_after: list | None = None,
) -> tuple[torch.Tensor, list[float] | None]:
    """`sample` with the tokens left on the logits' device ([S] int64, no host sync); the logprobs,
    when any row asks for them, come back to the host (one sync). `state`: as `adjust_logits`.
    `banned`: bool [S, V], tokens set to -inf after the adjustments (grammars' masks).
    `states_after` ([S] list): each random row's generator state right after its draw
    (speculative decoding rewinds a request to the last row it keeps)."""
    adjusted = adjust_logits(logits, params, histories, state)
    if banned is not None:  # a new tensor: the logprobs below read the raw logits
        adjusted = adjusted.masked_fill(banned, float("-inf"))
    tokens = adjusted.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = on_device(random_rows, logits.device, torch.int64)
        probs = sampling_logits(adjusted[idx], [params[i] for i in random_rows]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(random_rows):
            noise[row].exponential_(generator=generators[i])
            if states_after is not None:
                states_after[i] = generators[i].get_state()
        tokens[idx] = (probs / noise).argmax(dim=-1)
    if not any(p.logprobs for p in params):
        return tokens, None
    all_logprobs = logits.log_softmax(dim=-1)
    chosen = all_logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    out: list[float] = list(chosen)
    for i, p in enumerate(params):
        if p.top_logprobs > 0:
            values, ids = all_logprobs[i].topk(min(p.top_logprobs, logits.shape[-1]))
            out[i] = Logprob(chosen[i], tuple(zip(ids.tolist(), values.tolist())))
    return tokens, out


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[History] | None = None,
) -> tuple[list[int], list[float] | None]:
    tokens, logprobs = sample_tokens(logits, params, generators, histories)
    return tokens.tolist(), logprobs


def take_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] for increasing rows; all of them (the decode case) is a view. The index reaches
    the device through pinned memory (`hidden[list]` copies it from pageable memory, which makes the
    host wait for the forward)."""
    if len(rows) == hidden.shape[0]:
        return hidden
    return hidden.index_select(0, on_device(rows, hidden.device, torch.int64))


def fused_sampler(device: torch.device):
    """The fused Triton sampling kernel on CUDA (worker/kernels/triton_sampling.py), else None."""
    if device.type != "cuda":
        return None
    try:
        from worker.kernels.triton_sampling import fused_sample
    except ImportError:  # no triton: the torch sampler
        log.warning("triton is not importable: sampling runs on the torch path")
        return None
    return fused_sample
