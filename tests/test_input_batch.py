"""Persistent batch state (worker/input_batch.py) against the rebuild-everything reference.

Every step of seeded random workloads (a KV pool small enough to preempt, shared prefixes that hit
the prefix cache, aborts, request ids reused after they end, chunked prefill mixed with decode)
builds its inputs both ways, `ModelRunner.prepare` (persistent state) and
`ModelRunner.prepare_reference` (Python lists), and they must be identical. With `mirror=True` the
same runs go through the staged single-transfer path and the device-side table scatter that CUDA
uses. The graph rows (padding included) are checked against `build_decode_inputs`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worker.config import EngineConfig, ModelConfig
from worker.cuda_graphs import build_decode_inputs
from worker.engine import LLMEngine
from worker.input_batch import InputBatch
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.sampler import plain_greedy
from worker.types import SamplingParams

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position=256,
)


def run_plan(engine: LLMEngine, plan) -> list:
    """The plan's step and the scheduler's update (`LLMEngine.step` without its bookkeeping)."""
    tokens = engine.runner.launch(plan)
    return engine.scheduler.update(plan, tokens.to_host(), tokens.accepted)


def make_engine(mirror: bool, num_blocks: int = 12, max_num_seqs: int = 4) -> LLMEngine:
    torch.manual_seed(0)
    config = EngineConfig(
        kv_cache_bytes=10**6,
        num_kv_blocks=num_blocks,
        block_size=4,
        attention_backend="torch",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=24,
        enforce_eager=True,
        num_speculative_tokens=3,  # drafted shares among the plans (speculative decoding)
        prompt_lookup_min=1,
    )
    runner = ModelRunner.from_model(config, LlamaModel(TINY).eval())
    if mirror:
        b = runner.input_batch
        runner.input_batch = InputBatch(b.max_rows, b.max_blocks, b.block_size, runner.device, mirror=True)
    return LLMEngine(config, runner=runner)


def check_same(runner: ModelRunner, plan) -> None:
    ids, pos, meta, rows = runner.prepare(plan)
    r_ids, r_pos, r_meta, r_rows = runner.prepare_reference(plan)
    assert ids.tolist() == r_ids.tolist() and pos.tolist() == r_pos.tolist() and rows == r_rows
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        got, ref = getattr(meta, name), getattr(r_meta, name)
        assert got.dtype == ref.dtype, name
        assert got.tolist() == ref.tolist(), name
    assert (meta.max_query_len, meta.max_seq_len) == (r_meta.max_query_len, r_meta.max_seq_len)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prepare_matches_reference_under_churn(mirror, seed):
    rng = random.Random(seed)
    engine = make_engine(mirror)
    shared = [rng.randrange(TINY.vocab_size) for _ in range(9)]
    next_id, live, preempted, hits, drafted = 0, set(), 0, 0, 0
    for step in range(120):
        if len(live) < 6 and rng.random() < 0.4:
            rid = f"r{rng.randrange(8)}"  # ids repeat once their request ended
            if rid not in live:
                prompt = ([*shared] if rng.random() < 0.5 else []) + [
                    rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 14))
                ]
                sp = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
                engine.add_request(rid, prompt, sp)
                live.add(rid)
                next_id += 1
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            engine.abort(rid)
        plan = engine.scheduler.schedule()
        preempted += len(plan.preempted)
        drafted += plan.drafted
        if not plan.is_empty:
            check_same(engine.runner, plan)
            for seq in plan.preempted:  # what run() does for them before building
                engine.runner.input_batch.drop(seq.request_id)
            for seq in run_plan(engine, plan):
                if seq.is_finished:
                    engine.runner.release(seq.request_id)
        engine.scheduler.check_integrity()
        live = {rid for rid in live if rid in engine.scheduler.requests}
    hits = engine.block_manager.num_prefix_hits
    assert preempted > 0 and hits > 0 and next_id > 8 and drafted > 0, (preempted, hits, next_id, drafted)


def test_rows_reclaimed_and_grown_without_drop():
    batch = InputBatch(2, 8, 4, torch.device("cpu"))
    engine = make_engine(False)
    for i in range(3):  # three requests, two rows, nothing dropped between plans
        engine.add_request(f"x{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    plan = engine.scheduler.schedule()
    step = batch.build(plan)
    assert batch.max_rows == 4 and len(set(step.rows.tolist())) == 3  # grew
    batch.graph_bound = True
    batch.build(type(plan)(plan.scheduled[:1]))  # reuses its row
    assert len(batch.row_of) == 3
    batch.free_rows.clear()
    other = type(plan)(plan.scheduled[1:2])
    other.scheduled[0].seq.request_id = "renamed"  # unknown id: reclaims rows absent from the plan
    batch.build(other)
    assert set(batch.row_of) == {"renamed"}


@pytest.mark.parametrize("mirror", [False, True])
def test_tables_grow_wider_without_graphs(mirror):
    """A table longer than max_blocks (a runner shared with an engine of a longer max_model_len)
    widens the buffers, entries kept; the step's inputs still equal the reference."""
    engine = make_engine(mirror, num_blocks=40)
    runner = engine.runner
    runner.input_batch = InputBatch(4, 2, 4, runner.device, mirror=mirror)  # 2 blocks = 8 tokens
    engine.add_request("short", [3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("long", list(range(1, 21)), SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        check_same(runner, plan)
        for seq in run_plan(engine, plan):
            if seq.is_finished:
                runner.release(seq.request_id)
    assert runner.input_batch.max_blocks >= 6
    runner.input_batch = bound = InputBatch(4, 2, 4, runner.device, mirror=mirror)
    bound.graph_bound = True  # a recorded graph holds the tables: they cannot move
    engine.add_request("longer", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ValueError, match="max_blocks"):
        runner.prepare(engine.scheduler.schedule())


def test_graph_rows_match_build_decode_inputs():
    engine = make_engine(False)
    for i, n in enumerate((5, 9, 2)):
        engine.add_request(f"g{i}", list(range(1, 1 + n)), SamplingParams(temperature=0, max_tokens=8))
    while True:
        plan = engine.scheduler.schedule()
        if all(s.num_new_tokens == 1 for s in plan.scheduled):
            break
        run_plan(engine, plan)
    batch = engine.runner.input_batch
    step = batch.build(plan)
    ref = build_decode_inputs(plan, 4, 4)
    rows = batch.graph_rows(step, 4)
    np.testing.assert_array_equal(rows[:3], ref.tokens.numpy())
    np.testing.assert_array_equal(rows[3], ref.seq_lens.numpy())
    tables = batch.tables_np[rows[4]]
    for r, table in enumerate(ref.block_tables.tolist()[:3]):
        own = plan.scheduled[r].seq.block_table
        assert tables[r].tolist() == own + [0] * (batch.max_blocks - len(own))
        assert table[: len(own)] == own
    assert step.sample_seq_idx == ref.logits_rows


def test_plain_greedy():
    assert plain_greedy(SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(1,), seed=4))
    assert plain_greedy(SamplingParams(temperature=0.7, top_k=1))
    assert not plain_greedy(SamplingParams(temperature=0, logprobs=True))
    assert not plain_greedy(SamplingParams(temperature=0.7))
