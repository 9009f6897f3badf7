"""Compiled CPU model step: inductor over the whole forward pass, the CPU counterpart of CUDA graphs.

Why: an eager decode step of a 30-layer model runs ~1,350 small torch ops from Python (norms,
RoPE, SwiGLU, residual adds), each a few microseconds of dispatch; at batch 1 that overhead is
larger than the matmuls. Compiled, each layer is a handful of fused C++ loops plus the matmuls
and one opaque attention call.

Contract:
- `CompiledCpuForward(model, kv_caches, backend, block_size)` compiles
  `forward(input_ids [T] int64, positions [T] int64, slot_mapping [T] int64,
  block_tables [S, W] int32, seq_lens [S] int32, query_start_loc [S+1] int32) -> hidden [T, C]`
  once, with dynamic shapes, and runs ANY plan through it (decode rows and prefill chunks alike).
- Attention (store the new K/V, then paged attention) is one custom op per layer,
  `llm::store_attend`, which mutates the layer's K/V cache in place and calls the eager backend
  (the "cpu" extension op, or the "torch" path); inductor keeps it opaque.
- Padding: every plan is padded to at least 2 tokens, 2 sequences and 2 block-table columns, so
  no dimension is ever 1 and torch.compile does not specialise (and recompile) on size-1 dims.
  A padding row is token 0 at position 0 with slot -1 (store skips it, so it never writes the
  cache), seq_len 1 and a block table of zeros; its output rows are dropped.
- The compiled code lives in inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`, default
  `~/.cache/llm-serve/inductor`), so a second start-up reuses it instead of compiling again.
- Fails how: if compilation raises (no C++ compiler, an unsupported op), `warmup()` logs the error
  and the runner falls back to eager for good (`self.failed`); the engine keeps serving.
- Proven by tests/test_cpu_compile.py: padded compiled forward == eager forward on mixed plans, and
  the engine's greedy tokens with compile == with --enforce-eager.
"""

from __future__ import annotations

import logging
import os
import time
import types
from pathlib import Path

import torch

from worker.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

# Set before inductor first asks for its cache directory (it then pins the variable itself).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "llm-serve" / "inductor"))

_BACKENDS: dict[int, AttentionBackend] = {}  # id -> backend, for the custom op's eager body


@torch.library.custom_op("llm::store_attend", mutates_args=("k_cache", "v_cache"))
def store_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    backend_id: int,
) -> torch.Tensor:
    """Store k/v (T, Hkv, D) at `slot_mapping`, then attend q (T, H, D); returns (T, H, D)."""
    backend = _BACKENDS[backend_id]
    if backend.prepare is None and not backend.takes_max_lens and q.dtype == k_cache.dtype:
        # The "cpu" op needs no host-side plan or lengths: skip building them (30x a step).
        backend.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return backend.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    meta = AttentionMetadata(
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        max_seq_len=max(lens),
    )
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale)


@store_attend.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, backend_id):
    return torch.empty_like(q)


class _OpBackend(AttentionBackend):
    """What the traced model sees: attention is one `llm::store_attend` call per layer."""

    def __init__(self, inner: AttentionBackend):
        super().__init__(f"compiled[{inner.name}]", None, None, False)
        self.inner_id = id(inner)
        _BACKENDS[self.inner_id] = inner

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        return torch.ops.llm.store_attend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            self.inner_id,
        )


def pad_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, min_size: int = 2
) -> tuple[torch.Tensor, ...]:
    """Pad a step's flat inputs so T, S and W are all >= `min_size` (see the module contract)."""
    t, (s, w) = input_ids.shape[0], meta.block_tables.shape
    pad_t, pad_s, pad_w = max(min_size - t, 0), max(min_size - s, 0), max(min_size - w, 0)
    slots, tables, lens, starts = meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc
    if pad_w:
        tables = torch.nn.functional.pad(tables, (0, pad_w))
    if pad_s or pad_t:
        # Each padding sequence takes one padding token; extra padding tokens join the last one.
        extra_s = max(pad_s, 1)
        extra_t = max(pad_t, extra_s)
        input_ids = torch.cat([input_ids, input_ids.new_zeros(extra_t)])
        positions = torch.cat([positions, positions.new_zeros(extra_t)])
        slots = torch.cat([slots, slots.new_full((extra_t,), -1)])
        tables = torch.cat([tables, tables.new_zeros(extra_s, tables.shape[1])])
        lens = torch.cat([lens, lens.new_ones(extra_s)])
        new_starts = torch.arange(1, extra_s + 1, dtype=starts.dtype) + t
        new_starts[-1] = t + extra_t
        starts = torch.cat([starts, new_starts])
        # A padding sequence whose query is longer than its 1-token context would be ill-formed.
        lens[-1] = max(int(lens[-1]), extra_t - extra_s + 1)
    return input_ids, positions, slots, tables, lens, starts


def _layer_step(layer, x, residual, rope_in, k_cache, v_cache, meta, backend):
    return layer(x, residual, rope_in, (k_cache, v_cache), meta, backend)


class CompiledCpuForward:
    _count = 0

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        block_size: int,
        warm_sizes: tuple[int, ...] = (2,),
    ):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        # Token counts warm-up compiles for. One size means one graph for every step, and the
        # per-call guard check is skipped after warm-up; several (a model whose modules branch on
        # the row count) keep the guards, which pick the graph.
        self.warm_sizes = tuple(max(2, n) for n in warm_sizes)
        self.op_backend = _OpBackend(backend)
        self.failed = False
        self.compile_s = 0.0
        import torch.fx.experimental._config as fx_config

        # Decode steps have T == S; without this, a first compile that saw equal sizes would
        # guard on it and a mixed step would compile again.
        fx_config.use_duck_shape = False
        # Regional compilation: the decoder layers share one graph (their weights are its
        # inputs), so compiling costs one layer, not the whole model, and the compiled code
        # lands in inductor's on-disk FX graph cache (freezing would bypass that cache).
        # Dynamo keys its cache on the code object: each runner gets its own copy, so another
        # model in the same process (tests) never adds entries this runner's guards would meet.
        CompiledCpuForward._count += 1
        code = _layer_step.__code__.replace(co_name=f"_layer_step_{CompiledCpuForward._count}")
        step = types.FunctionType(code, _layer_step.__globals__, code.co_name)
        self._layer = torch.compile(step, dynamic=True, fullgraph=True)
        self._warm = False
        self._skip_guards = True  # until a step shows the graph does not cover everything

    @staticmethod
    def supported(device: torch.device) -> bool:
        return device.type == "cpu"

    def _forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc):
        model = self.model
        meta = AttentionMetadata(
            slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len=0, max_seq_len=0
        )
        x = model.embed_tokens(input_ids)  # (T, C)
        rope_in = model.layers[0].self_attn.rope.tables(positions)
        residual = None
        for layer, (k_cache, v_cache) in zip(model.layers, self.kv_caches):
            x, residual = self._layer(layer, x, residual, rope_in, k_cache, v_cache, meta, self.op_backend)
        return model.norm(x)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """hidden (T, C) for the step's real tokens; runs compiled unless compilation failed."""
        t = input_ids.shape[0]
        with torch.inference_mode():
            # The graph was traced on inference tensors (the engine's steps run in inference
            # mode); a caller's ordinary tensor would fail a guard, so it is copied once.
            args = tuple(a if a.is_inference() else a.clone() for a in pad_inputs(input_ids, positions, meta))
        if not self._warm or len(self.warm_sizes) > 1 or not self._skip_guards:
            return self._forward(*args)[:t]
        # After warm-up the one graph covers every layer and step (all sizes symbolic, same
        # dtypes), so the per-call check of each layer's tensor guards is skipped. Should a step
        # still need a new graph (a guard the warm-up did not cover: seen when another engine in
        # the same process had compiled first), dynamo refuses under that stance; the guards are
        # then checked again for good and the step recompiles instead of failing.
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._forward(*args)[:t]
        except RuntimeError as exc:
            if "Recompilation triggered" not in str(exc):
                raise
            self._skip_guards = False
            log.warning("CPU model step: a step needed a new graph; guards are checked from now on")
            return self._forward(*args)[:t]

    def warmup(self) -> bool:
        """Compile now (or load from the on-disk cache) on a 2-sequence dummy step that writes no
        cache slot. Returns False, and leaves the runner on eager for good, if compiling fails."""
        start = time.perf_counter()
        try:
            # Inside inference mode, like every later step: dynamo guards on the tensors' mode.
            with torch.inference_mode():
                for n in self.warm_sizes:
                    # Two sequences: n - 1 prompt tokens and one more; no slot is written.
                    width = max(2, -(-n // self.block_size))
                    ids = torch.zeros(n, dtype=torch.int64)
                    meta = AttentionMetadata(
                        slot_mapping=torch.full((n,), -1, dtype=torch.int64),
                        block_tables=torch.zeros(2, width, dtype=torch.int32),
                        seq_lens=torch.tensor([n - 1, 1], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, n - 1, n], dtype=torch.int32),
                        max_query_len=n - 1,
                        max_seq_len=n - 1,
                    )
                    self(ids, ids.clone(), meta)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: serve eagerly
            self.failed = True
            log.warning(
                "compiling the CPU model step failed; serving eagerly: %s: %s",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return False
        self.compile_s = time.perf_counter() - start
        self._warm = True
        log.info(
            "CPU model step compiled in %.1fs (cache %s)",
            self.compile_s,
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )
        return True
