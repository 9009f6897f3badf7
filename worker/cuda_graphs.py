"""CUDA graphs for decode rows: replay a recorded forward pass instead of launching ~10 kernels
per layer from Python.

Contract:
- The decode rows of a step (sequences computing exactly one token) of `n` sequences run in the
  graph of the smallest captured batch size `>= n` (`capture_sizes`: 1, 2, 4, 8, then multiples of
  16, then `max_num_seqs`). In a mixed step the model runner runs the prompt chunks in one eager
  launch next to it; more decode rows than the largest graph run eagerly.
- Input: a `HostStep` from the persistent batch state (worker/input_batch.py). `run` writes its
  padded rows into one static `[5, max_bs]` int64 buffer (input_ids | positions | slot_mapping |
  seq_lens | block-table row) in one transfer and replays. Inside the graph, the block tables are
  gathered from the persistent device table by row, and `query_start_loc = arange(max_bs + 1)`.
  Padding rows: token 0 at position 0, slot -1 (store_kv skips it, so padding never writes the
  cache), seq_len 1 and table row 0 (they read one key; their output rows are dropped).
- Output: hidden states `[n, hidden]`, a view of the graph's static output that the next replay
  overwrites (the model runner turns it into logits at once).
- Why a graph may record one step for all later ones: the attention grid depends only on the batch
  size and the split count; each program reads its sequence's length from `seq_lens` on the device,
  and (split-KV) skips the splits its own length does not need (worker/kernels/triton_attention.py).
  Graphs are recorded with `max_seq_len` = the longest context, so the split count covers any
  shorter one.
- State: the static buffers, one graph and one output tensor per batch size, one shared memory pool;
  the persistent table (`InputBatch.tables_dev`) must keep its storage once captured.
- Fails how: capture raises if the forward synchronizes with the host (only the Triton attention
  backend is graph-safe: `supported()`).
- Proven by tests/test_cuda_graphs.py: bucket choice and padding, padded static forward ==
  unpadded eager forward (CPU), the runner's graph path with mixed steps == eager tokens (CPU, the
  static forward standing in for each replay), replayed logits and greedy tokens == eager (CUDA).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from worker.attention import AttentionBackend, AttentionMetadata
from worker.input_batch import HostStep, InputBatch
from worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to record: fine steps where decode batches are small, then every 16 rows."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size that holds `num_seqs` rows (sizes sorted ascending), or None."""
    return next((s for s in sizes if s >= num_seqs), None)


def is_decode_only(plan: SchedulerOutput) -> bool:
    return bool(plan.scheduled) and all(s.num_new_tokens == 1 for s in plan.scheduled)


@dataclass
class DecodeInputs:
    tokens: torch.Tensor  # (3, B) int64: input_ids, positions, slot_mapping
    seq_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, W) int32, W = longest block table in the plan
    logits_rows: list[int]  # rows whose sequence samples this step


def build_decode_inputs(plan: SchedulerOutput, block_size: int, batch_size: int) -> DecodeInputs:
    """Host tensors for a decode-only plan, padded to `batch_size` rows: the slow reference that
    `InputBatch.graph_rows` is tested against (tests/test_input_batch.py)."""
    num_pad = batch_size - len(plan.scheduled)
    assert num_pad >= 0 and is_decode_only(plan), "a decode-only plan that fits the batch size"
    width = max(len(s.seq.block_table) for s in plan.scheduled)
    ids, positions, slots, seq_lens, tables, logits_rows = [], [], [], [], [], []
    for row, s in enumerate(plan.scheduled):
        seq, pos = s.seq, s.seq.num_computed_tokens
        table = seq.block_table
        ids.append(seq.token_ids[pos])
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(pos + 1)
        tables.append(table + [0] * (width - len(table)))
        if s.samples:
            logits_rows.append(row)
    tokens = torch.tensor(
        [ids + [0] * num_pad, positions + [0] * num_pad, slots + [-1] * num_pad], dtype=torch.int64
    )
    return DecodeInputs(
        tokens,
        torch.tensor(seq_lens + [1] * num_pad, dtype=torch.int32),
        torch.tensor(tables + [[0] * width] * num_pad, dtype=torch.int32),
        logits_rows,
    )


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        batch_sizes: list[int],
        input_batch: InputBatch,
    ):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = sorted(batch_sizes)
        max_batch_size = self.sizes[-1]
        self.batch = input_batch
        self.block_size = input_batch.block_size
        self.max_seq_len = input_batch.max_blocks * input_batch.block_size
        dev = model.embed_tokens.weight.device
        # Rows: input_ids, positions, slot_mapping, seq_lens, block-table row (InputBatch.graph_rows).
        self.inputs = torch.zeros(5, max_batch_size, dtype=torch.int64, device=dev)
        self.inputs[2].fill_(-1)  # warm-up runs before capture write no K/V
        self.inputs[3].fill_(1)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.eager_replay = False  # tests on CPU: run() calls forward_static instead of a replay

    @staticmethod
    def supported(device: torch.device, backend: AttentionBackend) -> bool:
        # The torch and reference backends read lengths on the host (.tolist()): not capturable.
        return device.type == "cuda" and backend.name == "triton"

    def forward_static(self, batch_size: int) -> torch.Tensor:
        """The step a graph records: the model over the first `batch_size` rows of the buffers.
        The block table rows are gathered from the persistent table on the device, inside the graph."""
        b = batch_size
        meta = AttentionMetadata(
            slot_mapping=self.inputs[2, :b],
            block_tables=self.batch.tables_dev.index_select(0, self.inputs[4, :b]),
            seq_lens=self.inputs[3, :b].to(torch.int32),
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        return self.model(
            self.inputs[0, :b], self.inputs[1, :b], self.kv_caches, meta, self.backend
        )  # (B, C)

    def capture(self) -> None:
        """Record one graph per batch size; run() needs this, the rest of the class does not."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.batch.graph_bound = True
        # Largest first, so the smaller graphs fit in the memory the pool already holds.
        for b in reversed(self.sizes):
            self.forward_static(b)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward_static(b)
            self.graphs[b] = graph
        log.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1fs",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
        )

    def batch_size_for(self, plan: SchedulerOutput) -> int | None:
        """The graph this plan replays in, or None when it must run eagerly."""
        if not is_decode_only(plan):
            return None
        if max(len(s.seq.block_table) for s in plan.scheduled) > self.batch.max_blocks:
            return None
        return bucket_for(len(plan.scheduled), self.sizes)

    def run(self, step: HostStep, batch_size: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph of `batch_size` over a decode step built by `InputBatch.build`: hidden
        states of its sequences (a view of the static output, overwritten by the next replay).
        `tokens`: the previous step's sampled tokens, read on the device where `step.feed` says."""
        self.batch.load_graph_inputs(step, batch_size, self.inputs, tokens)
        if self.eager_replay:
            out = self.forward_static(batch_size)
        else:
            self.graphs[batch_size].replay()
            out = self.outputs[batch_size]
        return out[: step.rows.shape[0]]
