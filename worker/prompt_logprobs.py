"""Prompt logprobs: how likely the model finds each token of a prompt (`SamplingParams.prompt_logprobs`).

Contract
- `scored_chunks(shares) -> [(index in plan.scheduled, ScheduledSeq)]`: of a step's (index,
  share) pairs whose sequence reads prompt rows (`Sequence.reads_prompt`), the shares that
  compute prompt positions still to be scored (asked for, the chunk has a position whose next
  token is in the prompt, and the sequence does not hold every entry yet: a recomputation after
  preemption scores nothing).
- `score_prompt_rows(model, hidden [T, C], starts [S + 1], scored) -> [(sequence, first position,
  entries)]`: for each scored chunk, entry p = log P(prompt[p + 1] | prompt[..p]) from row p's
  logits, float32 log-softmax, `ROWS` rows at a time (256 x vocabulary x 4 bytes held at once);
  a `Logprob` carrying the N most likely tokens when prompt_logprobs N > 0. One host sync.
- State: none. The model runner calls both (worker/model_runner.py); the engine files the entries
  into their sequences at commit (`Sequence.add_prompt_logprobs`).
- Proven by tests/test_prompt_logprobs.py (against transformers: chunks, async scheduling,
  preemption, the decode-graph path; teacher forcing on the served default).
"""

from __future__ import annotations

import torch

from worker.sampling_ops import on_device
from worker.scheduler import ScheduledSeq
from worker.types import Logprob

ROWS = 256  # prompt rows whose float32 logits are held at once


def scored_chunks(shares: list[tuple[int, ScheduledSeq]]) -> list[tuple[int, ScheduledSeq]]:
    return [
        (i, s)
        for i, s in shares
        if s.seq.sampling.prompt_logprobs is not None
        and s.start < len(s.seq.prompt_token_ids) - 1
        and s.seq.needs_prompt_logprobs
    ]


def score_prompt_rows(
    model, hidden: torch.Tensor, starts, scored: list[tuple[int, ScheduledSeq]]
) -> list[tuple[object, int, list[float]]]:
    """(sequence, first position p, entries) per scored chunk: entry for position p is
    log P(prompt[p + 1] | prompt[..p]) from row p's logits, for the chunk's positions whose next
    token is in the prompt; a `Logprob` with the N most likely when prompt_logprobs N > 0.
    `starts`: the step's query_start_loc (row of each sequence's first token)."""
    rows: list[int] = []
    targets: list[int] = []
    spans = []
    for i, s in scored:
        prompt = s.seq.prompt_token_ids
        end = min(s.start + s.num_new_tokens, len(prompt) - 1)
        first_row = int(starts[i])
        rows.extend(range(first_row, first_row + end - s.start))
        targets.extend(prompt[s.start + 1 : end + 1])
        spans.append((s.seq, s.start, end - s.start))
    vocab = model.config.vocab_size
    top = min(max(s.seq.sampling.prompt_logprobs for _, s in scored), vocab)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    dev = hidden.device
    for k in range(0, len(rows), ROWS):
        idx = on_device(rows[k : k + ROWS], dev, torch.int64)
        logits = model.compute_logits(hidden.index_select(0, idx), upcast=True)
        lp = logits.log_softmax(dim=-1)
        target = on_device(targets[k : k + ROWS], dev, torch.int64)
        chosen += lp.gather(-1, target[:, None]).squeeze(-1).tolist()
        if top:
            values, ids = lp.topk(top, dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    out, k = [], 0
    for seq, first, n in spans:
        want = seq.sampling.prompt_logprobs
        entries: list[float] = chosen[k : k + n]
        if want:
            entries = [
                Logprob(c, tuple(zip(top_ids[k + j][:want], top_values[k + j][:want])))
                for j, c in enumerate(entries)
            ]
        out.append((seq, first, entries))
        k += n
    return out
