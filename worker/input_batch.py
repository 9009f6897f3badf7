"""Persistent batch state: the per-step model inputs built from preallocated buffers.

Contract:
- Input: each step's `SchedulerOutput`; `drop(request_id)` when a request ends (the runner calls
  it from `release`, and for every preempted sequence).
- State: a row per live request in a block-table buffer `[max_rows, max_blocks]` int32 (host;
  pinned with a device mirror on CUDA). A row is rewritten only when its sequence's `block_table`
  is a new list (first schedule, preemption, a reused request id) and otherwise extended by the
  entries appended since the last step (block tables only grow by `append`; `BlockManager.free`
  replaces the list). Changed entries reach the device as one scatter per step. Rows go back to a
  free list on `drop`; if none is free, rows of requests absent from the plan are reclaimed.
- Output: `build(plan, live, feed)` -> `HostStep` (numpy: token ids, positions, slots, seq lens,
  query start offsets, rows, the rows that sample, and the token indices `feed` names: their ids
  are read on the device from the previous step's sampled tokens, async scheduling's hand-off);
  `eager_inputs(step, tokens)` -> `(input_ids, positions, AttentionMetadata)` on the device after
  ONE host-to-device copy (a pinned staging buffer, two of them alternating, each reused only
  after its copy completed); `load_graph_inputs(step, batch_size, dst, tokens)` writes the padded
  `[5, B]` int64 rows (ids, positions, slots, seq lens, table rows) that a CUDA graph reads
  (worker/cuda_graphs.py), padding rows as that module's contract says.
- Cost: O(1) Python per decoding sequence (no B x W lists); the slots come from the table by one
  numpy gather.
- Fails how: more live rows than `max_rows` or a table wider than `max_blocks` grow the buffers;
  once a CUDA graph holds them they cannot move: RuntimeError / ValueError instead.
- Proven by tests/test_input_batch.py: inputs equal `reference_inputs` (below; the runner's
  `prepare_reference`: the plain rebuild-everything path) step by step through preemption, prefix
  hits, aborts and reused ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.attention import AttentionMetadata
from worker.scheduler import SchedulerOutput


@dataclass
class HostStep:
    ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slots: np.ndarray  # (T,) int64
    seq_lens: np.ndarray  # (S,) int64
    query_start_loc: np.ndarray  # (S+1,) int64
    rows: np.ndarray  # (S,) int64: block-table buffer row of each sequence
    width: int  # longest block table in the step
    # token index (eager) / sequence index (graph) of the sampling rows: one per sampling sequence,
    # 1 + len(draft) for a drafted one (speculative decoding: all its tokens, in order)
    logits_rows: list[int]
    sample_seq_idx: list[int]  # sequence index of each sampling row
    max_query_len: int
    updates: tuple[np.ndarray, np.ndarray]  # flat table indices and values changed this step
    # Token indices whose id is read on the device from the previous step's tokens, and the row
    # of each there (async scheduling's placeholders; the host `ids` hold 0 at those indices).
    feed: tuple[np.ndarray, np.ndarray]


class InputBatch:
    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        mirror: bool | None = None,
    ):
        self.block_size, self.max_blocks, self.device = block_size, max_blocks, device
        # mirror: a device copy of the tables fed by one staged transfer per step (CUDA; tests force
        # it on CPU to run the same code); else the host buffers are the inputs themselves.
        self.mirror = device.type == "cuda" if mirror is None else mirror
        self.pin = self.mirror and torch.cuda.is_available()
        self.graph_bound = False  # set once a CUDA graph has recorded `tables_dev`
        self._alloc_tables(max_rows)
        self.row_of: dict[str, int] = {}
        self._staging: list[tuple[torch.Tensor, np.ndarray, object]] = []
        self._staging_next = 0
        self._dev_buf: torch.Tensor | None = None

    def _alloc_tables(self, max_rows: int, max_blocks: int | None = None) -> None:
        """(Re)allocate the tables with more rows or columns; the host copy carries every entry over
        and the device mirror is copied from it whole."""
        old = getattr(self, "tables", None)
        self.max_blocks = max_blocks or self.max_blocks
        self.tables = torch.zeros(max_rows, self.max_blocks, dtype=torch.int32, pin_memory=self.pin)
        self.tables_np = self.tables.numpy()
        if old is not None:
            self.tables_np[: old.shape[0], : old.shape[1]] = old.numpy()
        self.tables_dev = self.tables.to(self.device, copy=True) if self.mirror else self.tables
        n_old = 0 if old is None else old.shape[0]
        if old is None:
            self.free_rows: list[int] = []
            self.row_list: list[list[int] | None] = []
            self.row_len: list[int] = []
        # Extended in place: build() holds references to these lists.
        self.free_rows[:0] = range(max_rows - 1, n_old - 1, -1)
        self.row_list.extend([None] * (max_rows - n_old))
        self.row_len.extend([0] * (max_rows - n_old))

    @property
    def max_rows(self) -> int:
        return self.tables.shape[0]

    def drop(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.row_list[row] = None
            self.free_rows.append(row)

    def _assign(self, request_id: str, live: set[str]) -> int:
        if not self.free_rows:
            for rid in [r for r in self.row_of if r not in live]:
                self.drop(rid)  # rows of requests that ended without a drop (another engine)
        if not self.free_rows:
            if self.graph_bound:
                raise RuntimeError(f"more than {self.max_rows} live rows with CUDA graphs recorded")
            self._alloc_tables(2 * self.max_rows)
        row = self.free_rows.pop()
        self.row_of[request_id] = row
        return row

    def build(
        self, plan: SchedulerOutput, live: set[str] | None = None, feed: dict[str, int] | None = None
    ) -> HostStep:
        """Host inputs of `plan`; `live`: request ids whose rows must not be reclaimed (default: the
        plan's); `feed`: {request_id: row in the previous step's sampled tokens} of the decoding
        sequences whose input token is that one (its host value, a placeholder, is not read)."""
        bs, tables_np = self.block_size, self.tables_np
        row_of, row_list, row_len = self.row_of, self.row_list, self.row_len
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        logits_rows: list[int] = []
        sample_idx: list[int] = []
        upd_idx: list[int] = []
        upd_val: list[int] = []
        feed_dst: list[int] = []
        feed_src: list[int] = []
        width = 0
        t = 0
        for i, s in enumerate(plan.scheduled):
            # The plan's copy of the sequence's state (ScheduledSeq): with async scheduling the
            # engine thread moves the sequence on while this step is built.
            seq, n, start = s.seq, s.num_new_tokens, s.start
            row = row_of.get(seq.request_id)
            if row is None:
                if live is None:
                    live = {x.seq.request_id for x in plan.scheduled}
                row = self._assign(seq.request_id, live)
                tables_np = self.tables_np  # reallocated if the rows grew
            table, nb = s.block_table, s.num_blocks
            if row_list[row] is not table or row_len[row] != nb:
                first = row_len[row] if row_list[row] is table else 0
                if nb > self.max_blocks:
                    if self.graph_bound:
                        raise ValueError(f"block table of {nb} blocks > max_blocks {self.max_blocks}")
                    # Wider tables (a runner shared by engines of longer max_model_len, tests).
                    self._alloc_tables(self.max_rows, max(nb, 2 * self.max_blocks))
                    tables_np = self.tables_np
                    upd_idx.clear()  # the new mirror holds every entry written so far
                    upd_val.clear()
                # A new list may be shorter than the row's last one: zero the rest (padding = 0).
                end = max(nb, row_len[row]) if first == 0 else nb
                vals = table[first:nb] + [0] * (end - nb)
                tables_np[row, first:end] = vals
                if self.mirror:
                    base = row * self.max_blocks
                    upd_idx.extend(range(base + first, base + end))
                    upd_val.extend(vals)
                row_list[row], row_len[row] = table, nb
            if nb > width:
                width = nb
            rows.append(row)
            starts.append(start)
            counts.append(n)
            if n == 1:
                src = feed.get(seq.request_id) if feed else None
                if src is None:
                    ids.append(seq.token_ids[start])
                else:
                    ids.append(0)
                    feed_dst.append(t)
                    feed_src.append(src)
            elif s.draft:  # speculative decoding: the newest token, then the draft; each samples
                ids.append(seq.token_ids[start])
                ids.extend(s.draft)
                logits_rows.extend(range(t, t + n))
                sample_idx.extend([i] * n)
            else:
                ids.extend(seq.token_ids[start : start + n])
            t += n
            if s.samples and not s.draft:
                logits_rows.append(t - 1)
                sample_idx.append(i)
        st = np.array(starts, dtype=np.int64)
        cnt = np.array(counts, dtype=np.int64)
        rw = np.array(rows, dtype=np.int64)
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(cnt, out=qsl[1:])
        if t == len(rows):
            pos, tok_row = st, rw
        else:
            pos = np.arange(t, dtype=np.int64) + np.repeat(st - qsl[:-1], cnt)
            tok_row = np.repeat(rw, cnt)
        slots = tables_np[tok_row, pos // bs].astype(np.int64) * bs + pos % bs
        return HostStep(
            np.array(ids, dtype=np.int64),
            pos,
            slots,
            st + cnt,
            qsl,
            rw,
            width,
            logits_rows,
            sample_idx,
            int(cnt.max()),
            (np.array(upd_idx, dtype=np.int64), np.array(upd_val, dtype=np.int64)),
            (np.array(feed_dst, dtype=np.int64), np.array(feed_src, dtype=np.int64)),
        )

    # -- device transfer -------------------------------------------------------------------
    def _stage(self, parts: list[np.ndarray]) -> torch.Tensor:
        """Pack int64 arrays into a pinned buffer and copy them to the device in one transfer."""
        total = sum(p.shape[0] for p in parts)
        if not self._staging or self._staging[0][0].shape[0] < total:
            size = max(total, 4096)
            self._staging = []
            for _ in range(2):
                host = torch.empty(size, dtype=torch.int64, pin_memory=self.pin)
                event = torch.cuda.Event() if self.device.type == "cuda" else None
                self._staging.append((host, host.numpy(), event))
            self._dev_buf = torch.empty(2, size, dtype=torch.int64, device=self.device)
        k = self._staging_next
        self._staging_next ^= 1
        host, host_np, done = self._staging[k]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has completed
        off = 0
        for p in parts:
            host_np[off : off + p.shape[0]] = p
            off += p.shape[0]
        dev = self._dev_buf[k, :total]
        dev.copy_(host[:total], non_blocking=self.pin)
        if done is not None:
            done.record()
        return dev

    def _apply_updates(self, dev: torch.Tensor, off: int, n: int) -> None:
        if n:
            self.tables_dev.view(-1)[dev[off : off + n]] = dev[off + n : off + 2 * n].to(torch.int32)

    @staticmethod
    def _feed(ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor | None) -> None:
        """ids[dst] = tokens[src] where the device is (no host sync)."""
        if dst.shape[0]:
            assert tokens is not None, "a step with placeholders needs the previous step's tokens"
            ids[dst] = tokens.index_select(0, src)

    def eager_inputs(
        self, step: HostStep, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device inputs of `step`; `tokens`: the previous step's sampled tokens, if `step.feed`."""
        t, s, w = step.ids.shape[0], step.rows.shape[0], step.width
        feed_dst, feed_src = step.feed
        f = feed_dst.shape[0]
        if not self.mirror:
            ids = torch.from_numpy(step.ids)
            self._feed(ids, torch.from_numpy(feed_dst), torch.from_numpy(feed_src), tokens)
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(step.slots),
                block_tables=torch.from_numpy(self.tables_np[step.rows, :w]),
                seq_lens=torch.from_numpy(step.seq_lens.astype(np.int32)),
                query_start_loc=torch.from_numpy(step.query_start_loc.astype(np.int32)),
                max_query_len=step.max_query_len,
                max_seq_len=int(step.seq_lens.max()),
            )
            return ids, torch.from_numpy(step.positions), meta
        upd_idx, upd_val = step.updates
        n = upd_idx.shape[0]
        dev = self._stage(
            [step.ids, step.positions, step.slots, step.seq_lens, step.query_start_loc, step.rows]
            + [upd_idx, upd_val, feed_dst, feed_src]
        )
        o = 3 * t + 2 * s + 1
        self._apply_updates(dev, o + s, n)
        fo = o + s + 2 * n
        self._feed(dev[:t], dev[fo : fo + f], dev[fo + f : fo + 2 * f], tokens)
        meta = AttentionMetadata(
            slot_mapping=dev[2 * t : 3 * t],
            block_tables=self.tables_dev[:, :w].index_select(0, dev[o : o + s]),
            seq_lens=dev[3 * t : 3 * t + s].to(torch.int32),
            query_start_loc=dev[3 * t + s : o].to(torch.int32),
            max_query_len=step.max_query_len,
            max_seq_len=int(step.seq_lens.max()),
        )
        return dev[:t], dev[t : 2 * t], meta

    def graph_rows(self, step: HostStep, batch_size: int) -> np.ndarray:
        """The `[5, B]` int64 rows a decode graph reads: ids, positions, slots, seq lens, table rows;
        padding: token 0 at position 0, slot -1, length 1, table row 0."""
        s = step.rows.shape[0]
        out = np.empty((5, batch_size), dtype=np.int64)
        out[0, :s], out[1, :s], out[2, :s] = step.ids, step.positions, step.slots
        out[3, :s], out[4, :s] = step.seq_lens, step.rows
        out[:, s:] = np.array([[0], [0], [-1], [1], [0]], dtype=np.int64)
        return out

    def load_graph_inputs(
        self, step: HostStep, batch_size: int, dst: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> None:
        """Write the graph rows into `dst` ([5, >= B] int64 on the device) and apply the step's
        table updates (one transfer on CUDA); `tokens`: the previous step's, if `step.feed`."""
        rows = self.graph_rows(step, batch_size)
        feed_dst, feed_src = step.feed
        f = feed_dst.shape[0]
        if not self.mirror:
            dst[:, :batch_size].copy_(torch.from_numpy(rows))
            self._feed(dst[0], torch.from_numpy(feed_dst), torch.from_numpy(feed_src), tokens)
            return
        upd_idx, upd_val = step.updates
        n = upd_idx.shape[0]
        dev = self._stage([rows.reshape(-1), upd_idx, upd_val, feed_dst, feed_src])
        self._apply_updates(dev, 5 * batch_size, n)
        dst[:, :batch_size].copy_(dev[: 5 * batch_size].view(5, batch_size))
        fo = 5 * batch_size + 2 * n
        self._feed(dst[0], dev[fo : fo + f], dev[fo + f : fo + 2 * f], tokens)


def reference_inputs(
    plan: SchedulerOutput, block_size: int, device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """The slow reference of `InputBatch.build` + `eager_inputs` (ModelRunner.prepare_reference):
    every input of `plan` rebuilt from Python lists."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    logits_rows: list[int] = []
    max_blocks = max(len(s.seq.block_table) for s in plan.scheduled)
    tables = []
    for s in plan.scheduled:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = seq.block_table
        input_ids.extend((seq.token_ids + list(s.draft))[start:end])
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        seq_lens.append(end)
        starts.append(starts[-1] + s.num_new_tokens)
        tables.append(table + [0] * (max_blocks - len(table)))
        if s.draft:
            logits_rows.extend(range(starts[-2], starts[-1]))
        elif s.samples:
            logits_rows.append(starts[-1] - 1)
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        max_query_len=max(s.num_new_tokens for s in plan.scheduled),
        max_seq_len=max(seq_lens),
    )
    return (
        torch.tensor(input_ids, dtype=torch.int64, device=dev),
        torch.tensor(positions, dtype=torch.int64, device=dev),
        meta,
        logits_rows,
    )
