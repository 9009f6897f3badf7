"""Megatron-style shards of a Llama checkpoint: what rank r of N reads, and the model it builds.

Contract
- input: the model's `ModelConfig`, the loader's lazy checkpoint tensors (worker/model/checkpoint.py:
  safetensors or GGUF, Hugging Face names), and (rank, size).
- output: `shard_config(cfg, size)`: the config of one rank's model (q and KV heads and the MLP's
  intermediate size divided by `size`; hidden size, vocabulary, norms unchanged), and
  `shard_tensors(...)`: the same names mapped to lazy slices, so that `loader.build_model` builds the
  rank's model reading only its slices:
  - column-parallel (output rows split): q/k/v (and their biases, head-aligned: rank r owns q heads
    [r*H/N, (r+1)*H/N) and KV heads [r*Hkv/N, ...), which keeps each q head with its KV head) and
    gate/up: only those rows are read (safetensors slices; GGUF rows after the Q/K un-permutation);
  - row-parallel (input columns split): o_proj and down_proj: rows are read in chunks of 2,048 and
    narrowed to the rank's columns (safetensors reads only the columns); their outputs are partial
    sums that one all-reduce per projection adds up (worker/model/llama.py `all_reduce`);
  - the logits are vocab-parallel (each rank multiplies by its V/N rows of the lm_head, rank 0
    gathers them: docs/tensor-parallel.md gives the measured reason), so an untied lm_head is
    row-split (each rank reads and holds V/N rows); the embedding (also a tied lm_head) and the
    norms are replicated.
- quantized weights: tensor parallel runs dense weights. quantization "auto" dequantizes quantized
  GGUF tensors to --dtype (logged); an explicit int8/int4 is refused (ValueError), since the int4
  groups and per-row scales would have to be cut along the shard boundaries.
- failure modes (ValueError, at start, before any rank process exists): a size that does not divide
  the KV heads, the q heads, the intermediate size or the vocabulary, naming the model's counts
  and the sizes that would work.
- proven by tests/test_tp_model.py (every rank's slices reassemble the unsharded weights; the
  sharded group's logits equal TP=1's; the invalid sizes).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from worker.config import ModelConfig
from worker.model.checkpoint import CheckpointTensor, SafetensorsTensor

log = logging.getLogger(__name__)


def valid_sizes(cfg: ModelConfig) -> list[int]:
    return [n for n in range(1, cfg.num_kv_heads + 1) if not _problems(cfg, n)]


def _problems(cfg: ModelConfig, size: int) -> list[str]:
    counts = (
        ("KV heads", cfg.num_kv_heads),
        ("attention heads", cfg.num_heads),
        ("intermediate size", cfg.intermediate_size),
        ("vocabulary entries", cfg.vocab_size),  # vocab-parallel logits
    )
    return [f"{count} {what}" for what, count in counts if count % size]


def check_size(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the problem when `size` ranks cannot split `cfg`."""
    problems = _problems(cfg, size)
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the {' and the '.join(problems)} of model "
            f"{cfg.name!r}; sizes that do: {', '.join(map(str, valid_sizes(cfg)))}"
        )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    check_size(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        lm_head_rows=None if cfg.tie_embeddings else cfg.vocab_size // size,
    )


def shard_mode(mode: str, dtype: str) -> str:
    """The loader's quantization mode under tensor parallelism (see the module docstring)."""
    if mode in ("int8", "int4"):
        raise ValueError(
            f"quantization {mode} is not supported with tensor_parallel_size > 1: shards run dense "
            "weights (use --quantization none, or auto to dequantize quantized GGUF tensors)"
        )
    if mode != "dense":
        log.info("tensor parallel: quantized checkpoint tensors are dequantized to %s", dtype)
    return "dense"


class RowSlice(CheckpointTensor):
    """Rows [a, b) of `base` (a 1-D tensor: elements [a, b))."""

    def __init__(self, base: CheckpointTensor, a: int, b: int):
        self.base, self.a, self.b = base, a, b
        self.name, self.type_name = base.name, base.type_name
        self.shape = (b - a, *base.shape[1:])

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[0] if stop is None else stop
        if len(self.base.shape) == 1:
            return self.base.dense()[self.a + start : self.a + stop]
        return self.base.dense(self.a + start, self.a + stop)

    def release(self) -> None:
        self.base.release()


class ColumnSlice(CheckpointTensor):
    """Columns [c0, c1) of the 2-D `base`."""

    def __init__(self, base: CheckpointTensor, c0: int, c1: int):
        self.base, self.c0, self.c1 = base, c0, c1
        self.name, self.type_name = base.name, base.type_name
        self.shape = (base.shape[0], c1 - c0)

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[0] if stop is None else stop
        if isinstance(self.base, SafetensorsTensor):  # reads only these columns
            return self.base.handle.get_slice(self.base.key)[start:stop, self.c0 : self.c1].float()
        return self.base.dense(start, stop)[:, self.c0 : self.c1].contiguous()

    def release(self) -> None:
        self.base.release()


def shard_tensors(
    tensors: dict[str, CheckpointTensor], cfg: ModelConfig, rank: int, size: int
) -> dict[str, CheckpointTensor]:
    """`tensors` (full model, Hugging Face names without "model.") with every split weight replaced
    by rank `rank`'s slice; replicated ones pass through."""
    check_size(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside [0, {size})")
    d = cfg.head_dim
    q, kv, f = cfg.num_heads * d // size, cfg.num_kv_heads * d // size, cfg.intermediate_size // size
    v = cfg.vocab_size // size  # an untied lm_head: vocab-parallel rows (a tied one is the embedding)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": f, "up_proj": f, "lm_head": v}
    cols = {"o_proj": q, "down_proj": f}
    out: dict[str, CheckpointTensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if kind in rows:
            n = rows[kind]
            out[name] = RowSlice(t, rank * n, (rank + 1) * n)
        elif kind in cols and parts[-1] == "weight":
            n = cols[kind]
            out[name] = ColumnSlice(t, rank * n, (rank + 1) * n)
        else:
            out[name] = t
    return out


def read_model_config(path: str | Path | None) -> ModelConfig:
    """The architecture of the checkpoint at `path` (default: the embedded model), from its header
    only: cheap enough to check a TP size before any rank starts."""
    import json

    from common.model_files import default_model_path, read_gguf_metadata
    from worker.model.checkpoint import gguf_model_config, hf_model_config

    path = Path(path) if path else default_model_path()
    if path.is_dir():
        cfg = hf_model_config(json.loads((path / "config.json").read_text()))
        return dataclasses.replace(cfg, name=path.name) if cfg.name in ("llama", "qwen2", "mistral") else cfg
    return gguf_model_config(read_gguf_metadata(path))
