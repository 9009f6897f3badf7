"""Token sampling: greedy, temperature, min-p, top-k, top-p, penalties, logit bias, per-request
seeds, chosen-token and top-N logprobs.

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
   min_p x the largest), then top-k, then top-p (the smallest set whose mass reaches top_p).
3. Draw by the exponential race (argmax p / E, E ~ Exp(1)), which draws exactly from p. Each row
   has its own `torch.Generator` (the request's seed, or one from the engine's seeded generator),
   so the same seed gives the same tokens whatever else is in the batch.
Speculative decoding (`RequestSampler.verify`): a drafted request has several consecutive rows,
drawn in order from its one stream as consecutive steps would draw them; after the drafts are
checked its stream is rewound to just after the last row kept.
Logprobs are log-softmax of the raw logits (before bias, penalties, temperature and truncation), as
vLLM reports them; with `top_logprobs` N each is a `worker.types.Logprob` carrying the N most
likely tokens.
Proven by tests/test_sampler.py: reproducibility and distribution tests, and every step against
the pure-Python reference in worker/sampler_reference.py (logits, drawn tokens, top-N logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.grammar import Grammars
from worker.speculative import accepted_prefix
from worker.types import Logprob, SamplingParams

History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, prompt + output ids)


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's largest probability."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


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
    """The logits the random draw uses for these (non-greedy) rows: temperature, min-p, top-k, top-p."""
    dev = logits.device
    out = logits / on_device([p.temperature for p in params], dev)[:, None]
    if any(p.min_p > 0 for p in params):
        out = apply_min_p(out, on_device([p.min_p for p in params], dev))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = on_device([p.top_k for p in params], dev)
        top_p = on_device([p.top_p for p in params], dev)
        out = apply_top_k_top_p(out, top_k, top_p)
    return out


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


class SampledTokens:
    """One step's sampled tokens: `tokens` ([S] int64) on the device, row i for `request_ids[i]`,
    for the next step to read there (async scheduling: no host round trip between two steps); and
    a copy on its way to the host (`to_host()`: the step's one host sync, on the thread that needs
    the values). `logprobs[i]` is None for rows that did not ask for them."""

    def __init__(
        self, request_ids: list[str], tokens: torch.Tensor, logprobs: list[float | None] | None = None
    ):
        self.request_ids, self.tokens, self.logprobs = request_ids, tokens, logprobs
        # Speculative decoding (`RequestSampler.verify`): {request_id: [(token, logprob | None)]},
        # the draft tokens each drafted request keeps, before its row's token.
        self.accepted: dict[str, list[tuple[int, float | None]]] = {}
        # (sequence, first entry, entries) of the prompt logprobs the step computed (on the host)
        self.prompt: list[tuple[object, int, list[float]]] = []
        self._ready = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens
        self._rows: dict[str, int] | None = None

    @property
    def rows(self) -> dict[str, int]:
        """{request_id: its row in `tokens`} of the requests that sampled this step."""
        if self._rows is None:
            self._rows = {rid: i for i, rid in enumerate(self.request_ids)}
        return self._rows

    def row(self, request_id: str) -> int:
        """The row of `request_id` in `tokens` (KeyError if it did not sample this step)."""
        return self.rows[request_id]

    def host_list(self) -> list[int]:
        """The tokens, row by row, after the copy to the host has landed."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def to_host(self) -> dict[str, tuple[int, float | None]]:
        """{request_id: (token, logprob | None)}, after the copy to the host has landed."""
        ids = self.host_list()
        return dict(zip(self.request_ids, zip(ids, self.logprobs or [None] * len(ids))))


def fusable(p: SamplingParams) -> bool:
    """Rows the fused kernel samples (worker/kernels/triton_sampling.py): no logprobs, logit bias,
    penalties or grammar."""
    return not (p.logprobs or p.logit_bias or p.needs_history or p.grammar)


class RequestSampler:
    """A model runner's sampling: the per-request state and, per row, the path.

    - Plain greedy batches (`plain_greedy`): the argmax of the logits: on CUDA the two-pass
      Triton kernel over the model-dtype logits (`greedy_argmax`, worker/kernels/triton_argmax.py:
      torch's argmax reduces a 128k row in one block); on CPU with the "cpu" backend's fused ops the
      C++ `argmax_rows` over the model-dtype logits (worker/kernels/cpu_fused.py; given by the
      model runner), else torch's over their float32 copy (torch's CPU argmax is ~3x slower on bfloat16).
    - With `fused` (the Triton kernel, on CUDA): the rows it can take (`fusable`) are sampled from
      the model-dtype logits in one launch, with no float32 `[S, V]` copy: noise from Philox keyed
      by the request's seed and the number of tokens it sampled so far. A request's rows always
      take the same path (it depends on its own parameters only), so a seed gives the same tokens
      whatever else is in the batch.
    - The other rows: `sample_tokens` over their float32 logits, with one `torch.Generator` per
      request, and penalties reading the request's statistics on the device (`penalty_state`, built
      from the prompt at its first sampling step, `record_tokens` after each).
    - Rows with a grammar (structured output) take the torch path with their matcher's mask
      (`seq.matcher`, worker/grammar.py), and their tokens come to the host at once (one sync) to
      advance each matcher before the next step's mask.
    Seeds of unseeded requests are drawn from a CPU generator seeded by the engine (a CUDA one
    would sync to read it). `release(request_id)` drops a request's state.
    """

    def __init__(self, device: torch.device, seed: int, fused=None, greedy_argmax=None):
        self.device, self.fused = torch.device(device), fused
        # Plain-greedy batches' argmax over model-dtype logits: the caller's, else Triton's on CUDA.
        self.greedy_argmax = greedy_argmax or _triton_argmax(self.device)
        self.seed_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.philox: dict[str, list[int]] = {}  # request id -> [seed, tokens sampled so far]
        self.penalties: dict[str, torch.Tensor] = {}  # request id -> [2, vocab] (penalty_state)
        self.grammars: Grammars | None = None  # structured output (set by the model runner)
        self._keep_states = False
        # Speculative decoding: request id -> its generator's state after each of its rows this
        # step (random rows on the torch path), read by `verify`.
        self._row_states: dict[str, list] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.philox.pop(request_id, None)
        self.penalties.pop(request_id, None)

    def _seed(self, seed: int | None) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.seed_generator)) if seed is None else seed

    def _generator(self, seq) -> torch.Generator:
        gen = self.generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(self._seed(seq.sampling.seed))
            self.generators[seq.request_id] = gen
        return gen

    def _penalty_row(self, seq, vocab: int) -> torch.Tensor:
        row = self.penalties.get(seq.request_id)
        if row is None:  # its first sampling step: no output yet
            prompt = seq.prompt_token_ids
            row = self.penalties[seq.request_id] = penalty_state([(prompt, prompt)], vocab, self.device)[0]
        return row

    def sample(self, seqs: list, logits_fn, observer=None, drafted: bool = False) -> SampledTokens:
        """Tokens of `seqs` (each with `.request_id`, `.sampling`, `.prompt_token_ids`);
        `logits_fn(upcast)` gives their logits `[S, V]` (float32 if `upcast`, else the model dtype);
        `observer(request_ids, float32 logits)` (tests) sees every row, all on the torch path.
        `drafted` (speculative decoding): a request may have several consecutive rows, sampled in
        order from its one random stream, as consecutive steps would; `verify` follows."""
        self._keep_states = drafted
        self._row_states.clear()  # a step that failed before `verify` left its own
        params = [seq.sampling for seq in seqs]
        request_ids = [seq.request_id for seq in seqs]
        if observer is None and all([p.plain_greedy for p in params]):
            if self.greedy_argmax is not None:  # Triton (CUDA) / C++ (CPU) argmax, model-dtype logits
                return SampledTokens(request_ids, self.greedy_argmax(logits_fn(False)))
            logits = logits_fn(self.device.type == "cpu")
            return SampledTokens(request_ids, logits.argmax(dim=-1))
        fused = [i for i, p in enumerate(params) if fusable(p)] if self.fused and observer is None else []
        if len(fused) == len(seqs):
            return SampledTokens(request_ids, self._fused(logits_fn(False), seqs))
        if fused:
            logits = logits_fn(False)
            rest = [i for i, p in enumerate(params) if not fusable(p)]
            f_idx = on_device(fused, self.device, torch.int64)
            r_idx = on_device(rest, self.device, torch.int64)
            tokens = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
            tokens[f_idx] = self._fused(logits.index_select(0, f_idx), [seqs[i] for i in fused])
            sub, logprobs = self._torch([seqs[i] for i in rest], logits.index_select(0, r_idx).float())
            tokens[r_idx] = sub
            if logprobs is not None:
                merged: list = [None] * len(seqs)
                for k, i in enumerate(rest):
                    merged[i] = logprobs[k]
                logprobs = merged
            return SampledTokens(request_ids, tokens, logprobs)
        logits = logits_fn(True)
        if observer is not None:
            observer(request_ids, logits)
        tokens, logprobs = self._torch(seqs, logits)
        return SampledTokens(request_ids, tokens, logprobs)

    def verify(self, out: SampledTokens, drafts: dict[str, tuple[int, ...]]) -> SampledTokens:
        """Speculative decoding: `out` has 1 + len(draft) consecutive rows for each drafted
        request (worker/speculative.py). Keep the leading drafts its rows confirm; the row after
        them gives its token. Each drafted request's random stream is rewound to just after that
        row (generator state, or Philox counter), where consecutive steps without drafts would
        have left it. One row per request comes back, with `accepted` set; a host sync."""
        host, lps = out.host_list(), out.logprobs
        rids: list[str] = []
        tokens: list[int] = []
        logprobs: list[float | None] = []
        i = 0
        while i < len(host):
            rid = out.request_ids[i]
            draft = drafts.get(rid, ())
            a = accepted_prefix(host[i : i + len(draft)], draft)
            if draft:
                out.accepted[rid] = [(host[i + j], lps[i + j] if lps else None) for j in range(a)]
                states = self._row_states.get(rid)
                if states:
                    self.generators[rid].set_state(states[a])
                counter = self.philox.get(rid)
                if counter is not None:
                    counter[1] -= len(draft) - a
            rids.append(rid)
            tokens.append(host[i + a])
            logprobs.append(lps[i + a] if lps else None)
            i += len(draft) + 1
        self._row_states.clear()
        kept = SampledTokens(rids, torch.tensor(tokens, dtype=torch.int64), logprobs if lps else None)
        kept.accepted = out.accepted
        return kept

    def _fused(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        floats, ints = [], []
        for seq in seqs:
            p = seq.sampling
            state = self.philox.get(seq.request_id)
            if state is None:  # a uint64 seed (the API's range) as the int64 of the same 64 bits
                seed = self._seed(p.seed) & (2**64 - 1)
                state = self.philox[seq.request_id] = [seed - 2**64 if seed >= 2**63 else seed, 0]
            floats.append((p.temperature, p.top_p, p.min_p))
            ints.append((p.top_k, state[0], state[1]))
            state[1] += 1
        f = on_device(floats, self.device, torch.float32).T
        n = on_device(ints, self.device, torch.int64).T
        return self.fused(logits.contiguous(), f[0], n[0], f[1], f[2], n[1], n[2])

    def _torch(self, seqs: list, logits: torch.Tensor) -> tuple[torch.Tensor, list | None]:
        params = [seq.sampling for seq in seqs]
        gens = [None if p.greedy else self._generator(seq) for seq, p in zip(seqs, params)]
        penalized = [i for i, p in enumerate(params) if p.needs_history]
        states = [self._penalty_row(seqs[i], logits.shape[-1]) for i in penalized]
        state = torch.stack(states) if states else None
        banned = self.grammars.banned(seqs, logits.shape[-1], self.device) if self.grammars else None
        after = [None] * len(seqs) if self._keep_states else None
        tokens, logprobs = sample_tokens(logits, params, gens, state=state, banned=banned, states_after=after)
        if after is not None:
            for seq, state_after in zip(seqs, after):
                if state_after is not None:
                    self._row_states.setdefault(seq.request_id, []).append(state_after)
        if states:
            idx = on_device(penalized, self.device, torch.int64)
            record_tokens(states, tokens if len(penalized) == len(seqs) else tokens[idx])
        if banned is not None:  # the next mask needs these tokens: one host sync
            self.grammars.advance(seqs, tokens)
        if logprobs is not None:
            logprobs = [lp if p.logprobs else None for lp, p in zip(logprobs, params)]
        return tokens, logprobs


def _triton_argmax(device: torch.device):
    """worker/kernels/triton_argmax.py `argmax` on CUDA where triton imports, else None."""
    if device.type != "cuda":
        return None
    try:
        from worker.kernels.triton_argmax import argmax
    except ImportError:  # no triton: torch's argmax
        return None
    return argmax


def plain_greedy(p: SamplingParams) -> bool:
    """True when `p` is greedy with nothing that alters the argmax or asks for logprobs
    (`SamplingParams.plain_greedy`, computed once per params object)."""
    return p.plain_greedy
