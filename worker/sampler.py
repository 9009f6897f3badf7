"""A model runner's sampling: the per-request state (generators, Philox counters, penalty
statistics, grammars) and the path each row takes (`RequestSampler`), and a step's sampled tokens
on the device (`SampledTokens`). The batched ops they run (bias, penalties, temperature, min-p,
top-k, top-p, the exponential-race draw, logprobs) are worker/sampling_ops.py's.

Speculative decoding (`RequestSampler.verify`): a drafted request has several consecutive rows,
drawn in order from its one stream as consecutive steps would draw them; after the drafts are
checked its stream is rewound to just after the last row kept.
Proven by tests/test_request_sampler.py, tests/test_sampler.py and tests/test_speculative.py.
"""

from __future__ import annotations

import torch

from worker.grammar import Grammars
from worker.sampling_ops import on_device, penalty_state, record_tokens, sample_tokens
from worker.speculative import accepted_prefix
from worker.types import SamplingParams


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
        # Pooling (worker/pooling.py), on the host: (sequence, first position, rows, row sum) of
        # "mean" chunks, (sequence, vector) of "last" sequences
        self.pool_sums: list[tuple[object, int, int, torch.Tensor]] = []
        self.embeddings: list[tuple[object, torch.Tensor]] = []
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
      (`seq.matcher`, worker/grammar.py: started beside the forward pass by the model runner,
      joined here within the grammar step budget), and their tokens come to the host at once (one
      sync) to advance each matcher before the next step's mask.
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
        # Speculative decoding: request id -> its generator's state after each of its rows this
        # step (random rows on the torch path), read by `verify`.
        self._row_states: dict[str, list] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.philox.pop(request_id, None)
        self.penalties.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

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
            rest_logits = logits.index_select(0, r_idx).float()
            sub, logprobs = self._torch([seqs[i] for i in rest], rest_logits, drafted)
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
        tokens, logprobs = self._torch(seqs, logits, drafted)
        return SampledTokens(request_ids, tokens, logprobs)

    def verify(self, out: SampledTokens, drafts: dict[str, tuple[int, ...]]) -> SampledTokens:
        """Speculative decoding: `out` has 1 + len(draft) consecutive rows for each drafted
        request (worker/speculative.py). Keep the leading drafts its rows confirm; the row after
        them gives its token. Each drafted request's random stream is rewound to just after that
        row (generator state, or Philox counter), where consecutive steps without drafts would
        have left it. One row per request comes back, with `accepted` set; a host sync."""
        host, lps = out.host_list(), out.logprobs
        accepted: dict[str, list[tuple[int, float | None]]] = {}
        rids: list[str] = []
        tokens: list[int] = []
        logprobs: list[float | None] = []
        i = 0
        while i < len(host):
            rid = out.request_ids[i]
            draft = drafts.get(rid, ())
            a = accepted_prefix(host[i : i + len(draft)], draft)
            if draft:
                accepted[rid] = [(host[i + j], lps[i + j] if lps else None) for j in range(a)]
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
        kept.accepted = accepted
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

    def _torch(
        self, seqs: list, logits: torch.Tensor, drafted: bool = False
    ) -> tuple[torch.Tensor, list | None]:
        """Rows on the torch path; `drafted`: keep each random row's generator state (`verify`)."""
        params = [seq.sampling for seq in seqs]
        gens = [None if p.greedy else self._generator(seq) for seq, p in zip(seqs, params)]
        penalized = [i for i, p in enumerate(params) if p.needs_history]
        states = [self._penalty_row(seqs[i], logits.shape[-1]) for i in penalized]
        state = torch.stack(states) if states else None
        banned = self.grammars.banned(seqs, logits.shape[-1], self.device) if self.grammars else None
        after = [None] * len(seqs) if drafted else None
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
