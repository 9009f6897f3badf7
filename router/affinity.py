"""Prefix affinity: send requests that share leading token blocks to the worker that has them cached.

Contract
- input: `prefix_hashes(prompt_ids, salt)` -> chained hashes of the first `max_blocks` full
  blocks of `block_size` tokens (salted with the tenant, as the workers' prefix cache is, so
  tenants never attract each other's traffic); `choose(candidates_with_load, prefix_hashes,
  imbalance_threshold)` with each candidate worker's load (any unit: outstanding tokens, or a
  usage ratio) and the threshold in the same unit.
- output: the worker key that last served the deepest matching block, unless its load exceeds
  the least-loaded candidate's by more than `imbalance_threshold` (then shallower matches are
  tried, then the least-loaded candidate; ties: candidate order); None when there is no candidate.
- state: an LRU map block hash -> worker key, at most `max_entries` hashes; `choose` records its
  answer for every hash of the request (the chosen worker will hold those blocks).
- failure modes: none; a worker that left simply stops matching (it is not a candidate) and its
  entries age out of the LRU.
- proven by: tests/test_fairness_affinity.py (same system prompt -> same worker; imbalance
  overrides; tenant salt; LRU bound).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence

BLOCK_SIZE = 16  # tokens per block, as the workers' KV blocks
MAX_BLOCKS = 64  # leading blocks hashed: the first 1024 tokens


def prefix_hashes(
    token_ids: Sequence[int], salt: str, block_size: int = BLOCK_SIZE, max_blocks: int = MAX_BLOCKS
) -> list[bytes]:
    """hashes[i] identifies the whole prefix token_ids[:(i + 1) * block_size] (full blocks only)."""
    hashes: list[bytes] = []
    parent = salt.encode()
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[i * block_size : (i + 1) * block_size]))
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PrefixAffinity:
    def __init__(self, max_entries: int = 100_000):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def choose(
        self,
        candidates_with_load: Mapping[str, float],
        prefix_hashes: Sequence[bytes],
        imbalance_threshold: float,
    ) -> str | None:
        if not candidates_with_load:
            return None
        least = min(candidates_with_load, key=candidates_with_load.__getitem__)
        floor = candidates_with_load[least]
        chosen = least
        for h in reversed(prefix_hashes):  # deepest match first
            owner = self._owner.get(h)
            if owner in candidates_with_load and candidates_with_load[owner] - floor <= imbalance_threshold:
                chosen = owner
                break
        self._record(prefix_hashes, chosen)
        return chosen

    def matched_blocks(self, worker: str, prefix_hashes: Sequence[bytes]) -> int:
        """How many leading blocks `worker` last served (for metrics and tests)."""
        for depth in range(len(prefix_hashes), 0, -1):
            if self._owner.get(prefix_hashes[depth - 1]) == worker:
                return depth
        return 0

    def _record(self, prefix_hashes: Sequence[bytes], worker: str) -> None:
        for h in prefix_hashes:
            self._owner[h] = worker
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)
