"""Speculative decoding with n-gram drafts (prompt lookup): draft tokens from the sequence itself.

Contract:
- `NgramProposer(num_tokens, min_n, max_n).propose(token_ids, limit) -> list[int]`: the sequence's
  last n tokens (n from `max_n` down to `min_n`, the longest that matches) are looked up among its
  earlier tokens (prompt and output); at the latest earlier occurrence followed by a whole draft
  (else the latest), the tokens that followed it are the draft: at most `min(num_tokens, limit)`
  of them, [] when nothing matches. numpy over the last `window` tokens, O(window x max_n).
- The scheduler (worker/scheduler.py) asks for a draft for each decoding sequence that may take
  one (`draftable`), while at most `speculative_max_batch` sequences run and none waits, and
  plans `1 + len(draft)` tokens for it: its newest token, then the draft. One forward pass
  computes all of them; the sampler samples a token at every one of those rows, each with the
  request's own parameters and random stream, as if the draft were its output so far.
- `accepted_prefix(sampled, draft)`: the drafts kept are the leading ones that equal the token
  sampled before them; the first sampled token that differs (or the one after the whole draft)
  ends the step. This is exact for any sampling parameters: each kept token is what the model
  sampled at that position, given tokens that are all its own, so the output is distributed as
  without drafts, and with the same random stream per position (the sampler rewinds a request's
  generator to just after the last row it kept: worker/sampler.py `RequestSampler.verify`) greedy
  and seeded requests give the same tokens as without drafts.
- `Drafting`: the scheduler's half (worker/scheduler.py `Scheduler` inherits it): planning a
  drafted share (`_schedule_draft`) and taking a drafted step's tokens (`_take_drafted`).
- Not drafted: rows whose sampling reads the output so far (penalties) or follows a grammar; with
  async scheduling or tensor parallelism the engine drafts nothing (worker/engine.py).
- Proven by tests/test_speculative.py: the proposer against a plain-Python reference, and engines
  with drafts against engines without (greedy and seeded, logprobs, stop ids, max_tokens,
  preemption, aborts, prefix-cache hits, every KV block back in the pool).
"""

from __future__ import annotations

import numpy as np

from worker.plan import ScheduledSeq, SchedulerOutput
from worker.sequence import Sequence
from worker.types import SamplingParams

WINDOW = 8192  # tokens searched for a match, the newest


def draftable(sampling: SamplingParams) -> bool:
    """A request whose rows can be sampled several per step: no penalties (they read the output
    so far, which the draft would have to update row by row) and no grammar."""
    return not (sampling.needs_history or sampling.grammar)


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4, window: int = WINDOW):
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.num_tokens, self.min_n, self.max_n, self.window = num_tokens, min_n, max_n, window

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        arr = np.asarray(token_ids[-self.window :], dtype=np.int64)
        size = arr.shape[0]
        last = arr[-1]
        # Candidate ends: earlier positions holding the last token (never the last position itself).
        ends = np.flatnonzero(arr[:-1] == last)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # ends e with e >= n - 1 whose n-gram arr[e-n+1 .. e] equals the suffix
            cand = ends[ends >= n - 1]
            for j in range(1, n):
                if not cand.size:
                    break
                cand = cand[arr[cand - j] == arr[size - 1 - j]]
            if cand.size:
                # The latest occurrence followed by a whole draft, else the latest (a repeating
                # tail's latest match is followed by fewer tokens than an earlier one).
                full = cand[cand + k < size]
                start = int(full[-1] if full.size else cand[-1]) + 1
                return arr[start : start + k].tolist()
        return []


def accepted_prefix(sampled: list[int], draft: list[int]) -> int:
    """How many leading draft tokens the sampled rows confirm: `sampled[i]` is the token sampled
    after the newest token and `draft[:i]`; draft[i] is kept while it equals sampled[i]."""
    a = 0
    for token, guess in zip(sampled, draft):
        if token != guess:
            break
        a += 1
    return a


class Drafting:
    """worker/scheduler.py `Scheduler`'s speculative half: it reads the scheduler's `bm`,
    `running`, `proposer`, counters, `_stop_reason` and `_finish`."""

    def _schedule_draft(self, out: SchedulerOutput, seq: Sequence, room: int) -> bool:
        """Plan a decoding `seq` with a draft of at most `room` tokens; False when there is none. A
        draft never preempts: it takes new blocks only if the free ones left still cover the
        outstanding tokens of the running sequences after it, else it is cut to what the
        sequence's blocks hold."""
        bm = self.bm
        limit = min(room, seq.draft_len, seq.max_num_tokens - len(seq.token_ids) - 1)  # fits max_tokens
        draft = self.proposer.propose(seq.token_ids, limit) if limit > 0 else None
        if not draft:
            return False
        n = 1 + len(draft)
        held = len(seq.block_table) * bm.block_size - seq.num_computed_tokens  # tokens its blocks hold
        if n > held:
            extra = bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
            later = self.running[self.running.index(seq) + 1 :]
            reserve = sum(max(0, bm.blocks_needed(len(s.token_ids)) - len(s.block_table)) for s in later)
            if bm.num_free_blocks - extra < reserve or not bm.allocate(seq, n):
                if held < 2:
                    return False
                draft, n = draft[: held - 1], held  # the draft its blocks hold
        out.scheduled.append(ScheduledSeq(seq, n, tuple(draft)))
        out.drafted += 1
        return True

    def _take_drafted(
        self,
        seq: Sequence,
        num_drafted: int,
        accepted: list[tuple[int, float | None]],
        final: tuple[int, float | None],
        now: float,
    ) -> None:
        """A drafted sequence's step: the kept draft tokens, then the sampled one, up to the first
        that ends it. The KV of its newest token and the kept drafts is valid; what the rejected
        drafts wrote lies past the computed tokens and is overwritten by later steps, and the blocks
        only they filled go back to the pool at once."""
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += len(accepted)
        # The next draft's length: twice as long after a draft kept whole (up to the proposer's),
        # half after one rejected whole (down to 1): rejected rows cost compute and give nothing.
        if len(accepted) == num_drafted:
            seq.draft_len = min(2 * seq.draft_len, self.proposer.num_tokens)
        elif not accepted:
            seq.draft_len = max(seq.draft_len // 2, 1)
        token_ids, logprobs = seq.token_ids, seq.logprobs
        start = len(token_ids)
        for token, logprob in (*accepted, final):
            token_ids.append(token)
            if logprob is not None:
                logprobs.append(logprob)
            if token in seq.stop_ids or len(token_ids) >= seq.max_num_tokens:
                break
        self.num_generation_tokens += len(token_ids) - start - 1  # `update` counts one per sequence
        seq.num_computed_tokens = len(token_ids) - 1
        if seq.num_computed_tokens // self.bm.block_size > len(seq.block_hashes):
            self.bm.commit(seq)
        if seq.first_token_s is None:
            seq.first_token_s = now
        reason = self._stop_reason(seq, token_ids[-1])
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
        else:  # a block only rejected drafts wrote would sit idle, and the next step preempt for it
            self.bm.trim(seq, len(token_ids))
