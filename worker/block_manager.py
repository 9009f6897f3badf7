"""Paged KV-cache bookkeeping (pure Python, no torch): blocks, ref counts, LRU free queue, prefix cache.

Contract:
- Input: sequences asking for slots (`allocate(seq, num_new_tokens)`), reporting computed tokens
  (`commit(seq)`), giving back blocks a rejected draft took (`trim(seq, num_tokens)`), and ending
  (`free(seq)`).
- Output: `seq.block_table` (physical block ids, block_size tokens each) covers every token the
  sequence has computed or is about to compute.
- State: per block a ref count and an optional content hash; a free queue in LRU order (freed
  blocks keep their hash and can be revived by a prefix hit until they are reused); a map
  hash -> block. Hashes chain over full blocks: H(parent hash, token ids, salt), so equal hashes
  mean an equal whole prefix. The salt (the tenant) keeps tenants from sharing blocks.
- Fails how: `allocate` returns False when the pool is short (the scheduler then preempts); it
  never hands out a block that is in use.
- Proven by: `check_integrity()` after every step in tests/test_scheduler_props.py; prefix tests in
  tests/test_engine_prefix.py.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from worker.sequence import Sequence


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def token_bytes(token_ids: list[int]) -> bytes:
    """Each id as 4 little-endian unsigned bytes: `t.to_bytes(4, "little")` of each, in one C call."""
    a = array("I", token_ids)  # 4 bytes on every platform CPython supports; OverflowError if >= 2**32
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], salt: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or salt.encode())
    h.update(token_bytes(token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix; returns tokens hit.

        The last token is never taken from the cache: its logits must be computed.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            h = hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.salt)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            self._acquire(self.blocks[block_id])
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free_queue):
            return False
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
            if block.block_hash is not None:  # evict its cached content
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def commit(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Hash the blocks that became full of computed tokens, so later requests can share them.
        `num_computed`: the computed tokens whose values are known (async scheduling: the count a
        finished step reached; default seq.num_computed_tokens)."""
        bs = self.block_size
        upto = seq.num_computed_tokens if num_computed is None else num_computed
        for i in range(len(seq.block_hashes), upto // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.salt)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if self.enable_prefix_caching and h not in self.cached and block.block_hash is None:
                self.cached[h] = block.block_id
                block.block_hash = h

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back `seq`'s blocks past what `num_tokens` tokens need: a rejected draft's, written
        but never computed (so never hashed, never shared). They go first in line for reuse: unlike
        the other free blocks they cache nothing."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_table) <= keep:
            return
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, f"trimmed block {block_id} in use"
            block.ref_count = 0
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)
        # A new list, never `del` in place: InputBatch rewrites a sequence's device row only when
        # its list object (or length) changed (worker/plan.py).
        seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        # Tail blocks are freed first so they are evicted before the (more shareable) head blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _acquire(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def check_integrity(self, live: Iterable[Sequence]) -> None:
        refs = [0] * len(self.blocks)
        for seq in live:
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.request_id}: repeated block"
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, (
                f"{seq.request_id}: {seq.num_computed_tokens} computed tokens in "
                f"{len(seq.block_table)} blocks"
            )
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, used by {refs[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: ref_count {block.ref_count} vs free queue membership"
            )
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h, f"hash map points at stale block {block_id}"
