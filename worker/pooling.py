"""Pooling: a prompt's final hidden states as one vector, an embedding (`SamplingParams.pooling`).

Contract
- `pooled_chunks(shares) -> [(index in plan.scheduled, ScheduledSeq)]`: of a step's (index, share)
  pairs whose sequence reads prompt rows (`Sequence.reads_prompt`), the shares that compute prompt
  positions of a "mean" sequence (every chunk: a recomputation after preemption
  starts again from position 0, since such a prompt takes no prefix-cache hit).
- `chunk_sums(hidden [T, C], starts [S + 1], chunks) -> [(sequence, first position, rows, sum)]`:
  per chunk, the float32 sum [C] of its prompt rows' hidden states; one host copy for the step.
- `last_rows(hidden [S, C], seqs) -> [(sequence, vector)]`: the "last" sequences among the rows
  that sample (row i is `seqs[i]`'s): a sampling row of such a sequence is its last prompt token's
  (it samples once: max_tokens 1), float32 on the host.
- Hidden states are the model's output after its last norm (the rows the lm_head reads; the same
  tensor as transformers' `hidden_states[-1]` and llama.cpp's embeddings). Not normalized here.
- State: none. The model runner calls these (worker/model_runner.py); the engine files what a step
  read into its sequences at commit (`Sequence.add_pooled` / `Sequence.embedding`).
- Proven by tests/test_pooling.py (against transformers: chunks, async scheduling, preemption,
  prefix-cache hits, the decode-graph path; the served default).
"""

from __future__ import annotations

import torch

from worker.plan import ScheduledSeq


def pooled_chunks(shares: list[tuple[int, ScheduledSeq]]) -> list[tuple[int, ScheduledSeq]]:
    mean = [(i, s) for i, s in shares if s.seq.sampling.pooling == "mean"]
    return [(i, s) for i, s in mean if s.start < len(s.seq.prompt_token_ids)]


def chunk_sums(
    hidden: torch.Tensor, starts, chunks: list[tuple[int, ScheduledSeq]]
) -> list[tuple[object, int, int, torch.Tensor]]:
    sums, spans = [], []
    for i, s in chunks:
        rows = min(s.num_new_tokens, len(s.seq.prompt_token_ids) - s.start)
        first_row = int(starts[i])
        sums.append(hidden[first_row : first_row + rows].float().sum(dim=0))
        spans.append((s.seq, s.start, rows))
    host = torch.stack(sums).cpu()
    return [(seq, first, rows, host[k]) for k, (seq, first, rows) in enumerate(spans)]


def last_rows(hidden: torch.Tensor, seqs: list) -> list[tuple[object, torch.Tensor]]:
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.pooling == "last"]
    if not rows:
        return []
    host = hidden[rows].float().cpu()
    return [(seqs[i], host[k]) for k, i in enumerate(rows)]
