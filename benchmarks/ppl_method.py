"""The perplexity method of `make eval` (benchmarks/eval_ppl.py), llama-perplexity's
`perplexity()` with its defaults (see eval_ppl's docstring for the method in full).

Contract
- `read_text(path)` -> the file as llama-perplexity's `-f` reads it (one trailing newline removed);
  `tokenize(gguf_path, text)` -> (token ids of the whole text, BOS id or None when the GGUF's
  add_bos_token is off; BOS is put first when on).
- `num_chunks(num_tokens, n_ctx)` -> num_tokens // n_ctx; ValueError when n_ctx < 4 or there are
  fewer than 2 * n_ctx tokens. `chunk_input(tokens, i, n_ctx, bos_id)` -> chunk i as the model
  sees it (first token BOS when add_bos); `scored_targets(tokens, i, n_ctx)` -> the tokens after
  positions n_ctx // 2 .. n_ctx - 2; `token_nll(logits [n, vocab], targets [n])` -> float64 NLLs.
- `perplexity(tokens, n_ctx, logits_fn, bos_id=None, on_chunk=None)` -> PplResult(ppl,
  uncertainty (llama.cpp's +/-), count (tokens scored), num_chunks, chunk_ppls (running estimate
  after each chunk)). `logits_fn(chunk_ids, first)` returns logits [n_ctx - first - 1, vocab];
  another row count -> ValueError. Model-free: no state.
- `ModelScorer(model, dtype)`: a `logits_fn` over one of our models (each chunk one forward pass
  from an empty paged KV cache of that dtype, the default CPU attention backend, float32 logits);
  `weight_summary(model)` -> MiB of parameters and buffers per dtype.
- Tests: tests/test_eval_ppl.py (an oracle with a fixed probability, the scored positions,
  llama.cpp's uncertainty formula, an all-zero model = vocabulary size, a tiny random model vs
  transformers' logits, the bundled text as read).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class PplResult:
    ppl: float
    uncertainty: float
    count: int  # tokens scored
    num_chunks: int
    chunk_ppls: list[float] = field(default_factory=list)  # running estimate after each chunk


def read_text(path: pathlib.Path) -> str:
    """The file as llama-perplexity's `-f` reads it: one trailing newline removed."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def num_chunks(num_tokens: int, n_ctx: int) -> int:
    """Chunks llama-perplexity scores: len // n_ctx; it refuses fewer than 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise ValueError(f"context must be >= 4 tokens, got {n_ctx}")
    if num_tokens < 2 * n_ctx:
        raise ValueError(
            f"need at least {2 * n_ctx} tokens for a context of {n_ctx}, the text has {num_tokens}"
        )
    return num_tokens // n_ctx


def chunk_input(tokens: Sequence[int], index: int, n_ctx: int, bos_id: int | None) -> list[int]:
    """Chunk `index` as the model sees it: its first token replaced by BOS when add_bos."""
    ids = list(tokens[index * n_ctx : (index + 1) * n_ctx])
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def scored_targets(tokens: Sequence[int], index: int, n_ctx: int) -> list[int]:
    """The tokens chunk `index` is scored on: those after positions first..n_ctx-2."""
    first = n_ctx // 2
    start = index * n_ctx
    return list(tokens[start + first + 1 : start + n_ctx])


def token_nll(logits, targets):
    """-log softmax(logits)[target] per row, float64 (rows: [n, vocab] tensor, targets: [n])."""
    import torch

    logits = logits.to(torch.float64)
    targets = torch.as_tensor(targets, dtype=torch.int64)
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]


def perplexity(
    tokens: Sequence[int],
    n_ctx: int,
    logits_fn: Callable[[list[int], int], object],
    bos_id: int | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PplResult:
    """llama-perplexity's method (module docstring). `logits_fn(chunk_ids, first)` returns the
    logits of positions first..n_ctx-2 of the chunk, shape [n_ctx - first - 1, vocab]."""
    n_chunk = num_chunks(len(tokens), n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunk):
        logits = logits_fn(chunk_input(tokens, i, n_ctx, bos_id), first)
        targets = scored_targets(tokens, i, n_ctx)
        if tuple(logits.shape[:1]) != (len(targets),):
            raise ValueError(f"logits_fn gave {tuple(logits.shape)} rows for {len(targets)} targets")
        values = token_nll(logits, targets)
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        count += len(targets)
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk, running[-1])
    mean, mean2 = nll / count, nll2 / count
    var = mean2 - mean * mean
    ppl = math.exp(mean)
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PplResult(ppl, unc, count, n_chunk, running)


class ModelScorer:
    """`logits_fn` over one of our models: each chunk one forward pass from an empty paged KV
    cache (one sequence, positions 0..n-1), the default CPU attention backend (with its fused
    norm / RoPE / SiLU ops for bfloat16, as served), float32 logits."""

    def __init__(self, model, dtype: str, block_size: int = 16, attention_backend: str = "auto"):
        import torch

        from worker.attention import get_attention_backend

        self.model = model
        self.cfg = model.config
        self.dtype = getattr(torch, dtype)
        self.block_size = block_size
        # The model's dtype: bfloat16 runs the fused small ops as the served engine does.
        self.backend = get_attention_backend(attention_backend, torch.device("cpu"), model.dtype)

    def __call__(self, ids: list[int], first: int):
        import torch

        from worker.attention import AttentionMetadata

        n, bs, cfg = len(ids), self.block_size, self.cfg
        num_blocks = -(-n // bs)
        shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        kv = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(cfg.num_layers)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64),
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64),
                torch.arange(n, dtype=torch.int64),
                kv,
                meta,
                self.backend,
            )
            return self.model.compute_logits(hidden[first : n - 1]).float()


def weight_summary(model) -> dict[str, float]:
    """MiB of parameters and buffers per dtype: shows what the loader kept quantized."""
    out: dict[str, float] = {}
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0.0) + t.numel() * t.element_size() / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items())}


def tokenize(model_path: pathlib.Path, text: str) -> tuple[list[int], int | None]:
    """Token ids of the whole text and the BOS id to put first in each chunk (None: add_bos off)."""
    from common.model_files import read_gguf_metadata
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model_path)
    meta = read_gguf_metadata(model_path)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    ids = tok.encode(text)
    bos = meta.get("tokenizer.ggml.bos_token_id") if add_bos else None
    if add_bos and bos is not None:
        ids = [int(bos), *ids]
    return ids, (int(bos) if add_bos and bos is not None else None)
