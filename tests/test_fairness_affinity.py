"""Prefix affinity: shared leading blocks -> the same worker, unless the load is imbalanced."""

from __future__ import annotations

import random

from router.affinity import BLOCK_SIZE, PrefixAffinity, prefix_hashes

WORKERS = ("w0", "w1", "w2")


def test_repeated_system_prompts_stick_to_one_worker_each():
    rng = random.Random(0)
    system = {app: [rng.randrange(49152) for _ in range(512)] for app in ("chat", "code", "sql")}
    affinity = PrefixAffinity()
    load = dict.fromkeys(WORKERS, 0.0)  # outstanding tokens, as the balancer keeps them
    placed: dict[str, set[str]] = {app: set() for app in system}
    for _ in range(60):
        app = rng.choice(sorted(system))
        prompt = system[app] + [rng.randrange(49152) for _ in range(rng.randint(20, 60))]
        worker = affinity.choose(load, prefix_hashes(prompt, "tenant-a"), imbalance_threshold=2048)
        placed[app].add(worker)
        load[worker] += len(prompt)
        for w in load:  # requests finish: outstanding work drains
            load[w] *= 0.7
    assert all(len(workers) == 1 for workers in placed.values()), placed
    assert len(set.union(*placed.values())) == 3  # new prefixes went to the least-loaded worker


def test_imbalance_overrides_affinity_and_moves_the_prefix():
    affinity = PrefixAffinity()
    hashes = prefix_hashes(list(range(100)), "t")
    assert affinity.choose({"w0": 0, "w1": 0}, hashes, imbalance_threshold=100) == "w0"
    assert affinity.choose({"w0": 100, "w1": 0}, hashes, imbalance_threshold=100) == "w0"  # at threshold
    assert affinity.choose({"w0": 101, "w1": 0}, hashes, imbalance_threshold=100) == "w1"  # past it
    assert affinity.choose({"w0": 0, "w1": 50}, hashes, imbalance_threshold=100) == "w1"  # w1 served it last
    assert affinity.matched_blocks("w1", hashes) == len(hashes) == 100 // BLOCK_SIZE


def test_deepest_match_wins_and_shallower_matches_are_the_fallback():
    affinity = PrefixAffinity()
    base = list(range(64))  # 4 blocks
    short = prefix_hashes(base[:32], "t")  # 2 blocks
    long = prefix_hashes(base, "t")
    assert long[:2] == short
    affinity.choose({"w0": 0}, short, 0)  # w0 has the first two blocks
    affinity.choose({"w1": 0}, long, 0)  # w1 has all four (and took over the first two)
    affinity.choose({"w0": 0}, short, 0)  # w0 again for the first two
    assert affinity.choose({"w0": 0, "w1": 0}, long, imbalance_threshold=10) == "w1"  # 4 blocks > 2
    affinity.choose({"w0": 0}, short, 0)
    # w1 (4 blocks) is too busy; w0 (2 blocks) is within the threshold of the idle w2
    assert affinity.choose({"w0": 5, "w1": 50, "w2": 0}, long, imbalance_threshold=10) == "w0"


def test_gone_workers_and_no_candidates():
    affinity = PrefixAffinity()
    hashes = prefix_hashes(list(range(48)), "t")
    affinity.choose({"w9": 0}, hashes, 0)
    assert affinity.choose({"w0": 5, "w1": 3}, hashes, 100) == "w1"  # w9 left: least loaded
    assert affinity.choose({}, hashes, 100) is None


def test_hashes_are_chained_salted_and_cover_full_leading_blocks_only():
    ids = list(range(100))
    assert len(prefix_hashes(ids, "t")) == 6  # 96 tokens in full blocks; the tail does not count
    assert len(prefix_hashes(list(range(10_000)), "t")) == 64  # first 64 blocks (1024 tokens)
    assert len(prefix_hashes(ids, "t", max_blocks=2)) == 2
    assert prefix_hashes(ids[:15], "t") == []
    same_block_later = [0] * 16 + ids[:16]
    assert prefix_hashes(same_block_later, "t")[1] != prefix_hashes(ids[:16], "t")[0]  # position matters
    assert prefix_hashes(ids, "a")[0] != prefix_hashes(ids, "b")[0]  # tenants never share
    edited = ids[:40] + [7] + ids[41:]
    assert prefix_hashes(edited, "t")[:2] == prefix_hashes(ids, "t")[:2]
    assert prefix_hashes(edited, "t")[2:] != prefix_hashes(ids, "t")[2:]


def test_map_is_lru_bounded():
    affinity = PrefixAffinity(max_entries=8)
    old = prefix_hashes(list(range(64)), "t")  # 4 hashes
    affinity.choose({"w0": 0}, old, 0)
    for n in range(2):
        affinity.choose({"w1": 0}, prefix_hashes([1000 + n] * 64, "t"), 0)
    assert len(affinity) == 8
    assert affinity.matched_blocks("w0", old) == 0  # evicted, oldest first
    assert affinity.choose({"w1": 0, "w0": 0}, old, 1000) == "w1"  # no match left: least loaded
