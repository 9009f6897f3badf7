"""Pooling (`SamplingParams.pooling`): a prompt's final hidden states as an embedding.

Against transformers' last hidden state (after the final norm) of the same tiny random checkpoint:
"last" (the last prompt token's row) and "mean" (over the prompt's rows), prompts prefilled in
chunks, the synchronous and the async engine, one-token prompts, requests mixed with plain ones.
"last" keeps prefix-cache hits (the last row is always computed); "mean" computes the prompt whole.
Preemption (a small KV pool) recomputes a "mean" prompt from the start and the sum starts again.
With the decode graph path (the CPU stand-in for CUDA graphs) one-token prompts replay the graph
and every embedding equals the eager runner's. The served default (SmolLM2 int4) gives a finite
vector of its hidden size.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny_llama import TINY, arrivals_on_graphs_and_eager, save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.types import SamplingParams

PROMPTS = [
    [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19] * 2,  # 38: several chunks
    [44, 12],
    [3] * 37,
    [120],
    [120, 110, 100, 90, 80, 70, 60],
]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = save_tiny(tmp_path_factory.mktemp("tiny"), "llama3")
    return path, hf.eval()


def reference(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the last norm), pooled."""
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def pooled(pooling: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, pooling=pooling)


def run(engine: LLMEngine, requests: dict[str, tuple], low: frozenset = frozenset()) -> dict[str, dict]:
    """Every request (prompt, params) to the end, those in `low` at priority -1: {id: {"tokens",
    "embeddings" (each output's, in order), "cached", "preempted"}}."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp, priority=-1 if rid in low else 0)
    out = {rid: {"tokens": [], "embeddings": [], "cached": 0, "preempted": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            r = out[o.request_id]
            r["tokens"] += o.new_token_ids
            r["cached"], r["preempted"] = o.num_cached_tokens, o.num_preemptions
            if o.embedding is not None:
                r["embeddings"].append(o.embedding)
    return out


def check(hf, prompt: list[int], pooling: str, embeddings: list[list[float]]) -> None:
    assert len(embeddings) == 1, "sent once, with the token"
    got = torch.tensor(embeddings[0])
    want = reference(hf, prompt, pooling)
    assert got.shape == want.shape == (TINY.hidden_size,)
    assert float((got - want).abs().max()) <= TOL


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_embeddings_match_transformers(tiny, async_scheduling):
    path, hf = tiny
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_bytes=2**20,
            max_num_batched_tokens=8,  # the 38- and 37-token prompts take five chunks each
            async_scheduling=async_scheduling,
        )
    )
    # The first prompt's full blocks go into the prefix cache: "last" uses them, "mean" does not.
    run(engine, {"warm": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))})
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        for pooling in ("last", "mean"):
            requests[f"{pooling}{i}"] = (prompt, pooled(pooling))
    requests["plain"] = (PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    queries = engine.block_manager.num_prefix_queries
    out = run(engine, requests)
    looked_up = sum(len(p) for p in PROMPTS) + len(PROMPTS[2])  # the "last" ones and the plain one
    assert engine.block_manager.num_prefix_queries - queries == looked_up
    assert out["last0"]["cached"] == 32 and out["mean0"]["cached"] == 0
    assert out["plain"]["embeddings"] == []  # not asked for: never sent
    for i, prompt in enumerate(PROMPTS):
        for pooling in ("last", "mean"):
            r = out[f"{pooling}{i}"]
            assert len(r["tokens"]) == 1  # the one token max_tokens 1 asks for
            check(hf, prompt, pooling, r["embeddings"])
    assert out["last3"]["embeddings"] == out["mean3"]["embeddings"]  # one token: the same row
    engine.scheduler.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_restarts_the_mean(tiny, async_scheduling):
    path, hf = tiny
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        kv_cache_bytes=2**20,
        num_kv_blocks=8,  # 128 slots: the long decodes below preempt the pooled prompts
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Three decodes that each need a second block right after their prompt (9 blocks at the end).
    requests = {f"d{i}": ([i + 1] * 15, long) for i in range(3)}
    embedded = [PROMPTS[0], PROMPTS[2], PROMPTS[0] * 2, PROMPTS[4] * 4]
    for i, prompt in enumerate(embedded):
        requests[f"e{i}"] = (prompt, pooled("mean" if i % 2 == 0 else "last"))
    out = run(engine, requests, low=frozenset(f"e{i}" for i in range(len(embedded))))  # the victims
    assert out["e0"]["preempted"]  # a "mean" prompt computed again
    for i, prompt in enumerate(embedded):
        check(hf, prompt, "mean" if i % 2 == 0 else "last", out[f"e{i}"]["embeddings"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_a_stale_mean_chunk_is_left_out():
    """Sums arrive in commit order; a chunk at position 0 starts again, a chunk that does not
    continue the sum (one of a pass a recomputation replaced) is left out."""
    from worker.sequence import Sequence

    seq = Sequence("s", [1, 2, 3, 4], pooled("mean"))
    seq.add_pooled(0, 2, torch.tensor([2.0, 4.0]))
    seq.add_pooled(0, 1, torch.tensor([1.0, 1.0]))  # recomputation from the start
    seq.add_pooled(2, 2, torch.tensor([100.0, 100.0]))  # an old pass's: does not continue 0..1
    assert seq.embedding is None and seq.pool_upto == 1
    seq.add_pooled(1, 3, torch.tensor([3.0, 7.0]))
    assert seq.embedding == [1.0, 2.0]


def test_graph_path_pools_like_eager():
    """The decode-graph runner (its CPU stand-in) with arrivals joining running decodes: one-token
    "last" prompts replay the decode graph, "mean" chunks leave it; every embedding and token
    equals the eager runner's."""
    lengths = (19, 1, 37, 1, 11, 5)
    prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate(lengths)]

    def params_for(i: int) -> SamplingParams:
        if i % 2:
            return pooled("last" if i % 4 == 1 else "mean")
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def read(record: dict, output) -> None:
        if output.embedding is not None:
            record["embedding"] = output.embedding

    results = arrivals_on_graphs_and_eager(prompts, params_for, read)
    eager, graphs = results[False], results[True]
    for i in range(len(prompts)):
        got, want = graphs[f"r{i}"].get("embedding"), eager[f"r{i}"].get("embedding")
        assert (got is None) == (want is None) == (i % 2 == 0)
        if got is not None:
            assert float((torch.tensor(got) - torch.tensor(want)).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"pooling": "max", "max_tokens": 1}, "pooling must be one of last, mean"),
        ({"pooling": "mean", "max_tokens": 2}, "with max_tokens 1"),
    ],
)
def test_bad_pooling_is_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        SamplingParams(**kwargs)


def test_served_default_embeds():
    """The served default path (int4 weights, the C++ layer op): a finite vector of the model's
    hidden size, "last" and "mean" different, the same text twice the same vector."""
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20, num_threads=1))
    ids = Tokenizer.from_model(default_model_path()).encode("The quick brown fox jumps over the lazy dog.")
    out = run(
        engine,
        {"last": (ids, pooled("last")), "mean": (ids, pooled("mean")), "again": (ids, pooled("mean"))},
    )
    last, mean = out["last"]["embeddings"][0], out["mean"]["embeddings"][0]
    assert len(last) == len(mean) == engine.runner.model.config.hidden_size
    assert all(math.isfinite(v) for v in last + mean)
    assert last != mean and out["again"]["embeddings"][0] == mean
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()
