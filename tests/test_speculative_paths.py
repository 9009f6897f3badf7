"""Speculative decoding (worker/speculative.py) where it meets the KV pool and the CUDA-graph path:
a draft never takes a block a later sequence's decode needs (no preemption for a draft), and a
drafted chunk in a mixed step (eager, beside the decode graph; CPU stand-in for the replay) gives
the tokens of the eager engine and of the engine without drafts. Found by review."""

from __future__ import annotations

import torch

from tests.tiny_llama import record_graph_replays
from worker.block_manager import BlockManager
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.speculative import NgramProposer
from worker.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def two_decoding(proposer):
    """A (older, repetitive: it drafts) and B, both decoding, one free block left (block size 4):
    A's newest token fits its table, B's needs a new block."""
    bm = BlockManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, 4, 64, 128, proposer=proposer, draft_max_batch=4)
    a = Sequence("a", [5, 6, 7, 5, 6, 7, 5], GREEDY)  # 7 tokens: 2 blocks, room for position 7
    b = Sequence("b", [1, 2, 3, 4, 9, 10, 11, 12], GREEDY)  # 8 tokens: 2 full blocks
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == [7, 8]
    sched.update(plan, {"a": (6, None), "b": (13, None)})
    assert bm.num_free_blocks == 1
    return sched


def test_a_draft_leaves_the_block_another_decode_needs():
    """The last free block is B's (its next token starts a block): A's draft does not take it; A
    decodes its one token in its own blocks (one free slot: no room for a draft), B decodes."""
    plain = two_decoding(None).schedule()
    assert not plain.preempted and [s.seq.request_id for s in plain.scheduled] == ["a", "b"]
    sched = two_decoding(NgramProposer(4, 1, 3))
    plan = sched.schedule()
    assert not plan.preempted, f"preempted {[s.request_id for s in plan.preempted]} for a draft"
    assert [(s.seq.request_id, s.num_new_tokens, s.draft) for s in plan.scheduled] == [
        ("a", 1, ()),
        ("b", 1, ()),
    ]
    sched.check_integrity()


def test_a_draft_is_cut_to_the_blocks_it_holds():
    """With room for 3 tokens in A's blocks and no free block to spare, A's draft is cut to 2."""
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, 4, 64, 128, proposer=NgramProposer(4, 1, 3), draft_max_batch=4)
    a = Sequence("a", [5, 6, 7, 5, 6], GREEDY)  # 5 tokens: 2 blocks, room for positions 5-7
    b = Sequence("b", [1, 2, 3, 4, 9, 10, 11, 12], GREEDY)  # 8 tokens: its next token needs a block
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.update(plan, {"a": (7, None), "b": (13, None)})
    assert bm.num_free_blocks == 0 and a.num_computed_tokens == 5
    plan = sched.schedule()  # "5 6 7" seen before: a draft of 5, 6, 7, 5 would need a block
    assert plan.scheduled[0].draft == (5, 6) and plan.scheduled[0].num_new_tokens == 3
    sched.check_integrity()


def _graph_engine_tokens(graphs_on: bool, k: int):
    from tests.test_cuda_graphs import tiny_model

    prompts = [[(7 * i + j) % 9 + 1 for j in range(n)] for i, n in enumerate((19, 12, 37, 17, 11, 15))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 19, 14, 18, 15, 17)]
    config = EngineConfig(
        kv_cache_bytes=2**20,
        attention_backend="torch",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_speculative_tokens=k,
        prompt_lookup_min=1,
    )
    runner = ModelRunner.from_model(config, tiny_model("cpu"))
    kinds: list = []
    if graphs_on:
        record_graph_replays(runner, kinds, stand_in=True)
    engine = LLMEngine(config, runner=runner)
    mixed_drafted = []
    schedule = engine.scheduler.schedule

    def record():
        plan = schedule()
        n_dec = sum(s.num_new_tokens == 1 for s in plan.scheduled)
        mixed_drafted.append(plan.drafted > 0 and n_dec > 0)
        return plan

    engine.scheduler.schedule = record
    out = {}
    pending = list(enumerate(zip(prompts, params)))
    with torch.inference_mode():
        while pending or engine.has_unfinished_requests():
            if pending:
                i, (prompt, sp) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, sp)
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out, sum(mixed_drafted), kinds


def test_graph_mixed_step_with_drafts_matches_eager():
    """Drafted chunks run eager beside the decode graph (CPU stand-in for the replay): the same
    tokens as the eager engine with drafts and as the engine without."""
    eager, _, _ = _graph_engine_tokens(False, 3)
    plain, _, _ = _graph_engine_tokens(False, 0)
    graphs, n_mixed, kinds = _graph_engine_tokens(True, 3)
    assert eager == plain and graphs == eager
    assert n_mixed > 0 and kinds  # steps with a drafted chunk and decode rows, graphs replayed
