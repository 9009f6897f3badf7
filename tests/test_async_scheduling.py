"""Async scheduling (EngineConfig.async_scheduling, worker/engine.py) against the synchronous engine.

The same seeded random workloads run on two engines that differ only in the flag, and every
request must end with the same tokens, logprobs, finish reason and prompt / output counts; after
every step the scheduler's integrity holds and at the end every KV
block is back in the pool. The workloads mix arrivals between steps, aborts between steps (once a
request has produced a given number of tokens, the point a router's stop string would abort it),
EOS and stop token ids, max_tokens, greedy, seeded and penalized sampling, logprobs, priorities,
shared prefixes (prefix-cache hits) and KV pools small enough to preempt. Every test also asserts
that steps really overlapped (`num_overlapped_steps`), and where the pool preempts, that plans made
while a step was in flight preempted, so a broken or disabled overlap fails here. Preemptions are
not compared (the next step is planned before the step in flight's tokens are known, so its
EOS-ending sequences still count: worker/engine.py); tests/test_async_preemption.py takes them case
by case.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from worker.config import EngineConfig, ModelConfig, resolve_device
from worker.engine import LLMEngine
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import FinishReason, SamplingParams

TINY = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=512,
)
EOS = 3


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    arrive_after: int  # engine steps before it is added
    abort_at: int | None  # abort once it has this many output tokens (0: right after adding)
    priority: int = 0


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


def tiny_runner(config: EngineConfig) -> ModelRunner:
    """On the config's device: `auto` is CUDA where there is one (make gpu-session runs these)."""
    torch.manual_seed(1)
    model = LlamaModel(TINY).eval().to(resolve_device(config.device))
    return ModelRunner.from_model(config, model, eos_token_ids=(EOS,))


def random_sampling(rng: random.Random, penalties: bool) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy", "seeded", "logprobs", "stop"] + (["penalty"] if penalties else []))
    max_tokens = rng.randint(1, 24)
    if kind == "seeded":
        return SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1000), max_tokens=max_tokens)
    if kind == "logprobs":
        return SamplingParams(temperature=0, logprobs=True, top_logprobs=2, max_tokens=max_tokens)
    if kind == "stop":
        stops = tuple(rng.sample(range(TINY.vocab_size), 3))
        return SamplingParams(temperature=0, stop_token_ids=stops, max_tokens=max_tokens)
    if kind == "penalty":  # token statistics on the device, counted as each token is sampled
        return SamplingParams(
            temperature=0,
            repetition_penalty=rng.choice([1.0, 1.3]),
            frequency_penalty=rng.choice([0.0, 0.7]),
            presence_penalty=rng.choice([0.0, 0.5]),
            max_tokens=max_tokens,
        )
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)


def random_workload(seed: int, num_requests: int = 14, penalties: bool = False) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(4, 12))]
    requests = []
    for i in range(num_requests):
        tail = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 14))]
        prompt = (shared + tail) if rng.random() < 0.5 else tail
        abort_at = rng.choice([None, None, None, 0, 1, 2, 4, 7])
        requests.append(
            Request(
                f"r{i}",
                prompt,
                random_sampling(rng, penalties),
                arrive_after=rng.randint(0, 12),
                abort_at=abort_at,
                priority=rng.choice([0, 0, 0, 1]),
            )
        )
    return requests


def run(engine: LLMEngine, requests: list[Request], max_steps: int = 5000) -> dict[str, Result]:
    """Drive `engine` step by step: arrivals and aborts are decided between steps, by step count and
    by tokens produced (the same for a sync and an async engine)."""
    results = {r.request_id: Result([], []) for r in requests}
    pending = sorted(requests, key=lambda r: r.arrive_after)
    by_id = {r.request_id: r for r in requests}
    live: set[str] = set()
    for step in range(max_steps):
        while pending and pending[0].arrive_after <= step:
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt, r.sampling, r.priority)
            live.add(r.request_id)
            if r.abort_at == 0:
                assert engine.abort(r.request_id)
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            res = results[out.request_id]
            res.tokens += out.new_token_ids
            res.logprobs += out.new_logprobs or []
            res.num_prompt_tokens, res.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
            res.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                res.finish_reason = out.finish_reason
                live.discard(out.request_id)
        engine.scheduler.check_integrity()
        for rid in list(live):
            abort_at = by_id[rid].abort_at
            if abort_at and len(results[rid].tokens) >= abort_at:
                assert engine.abort(rid)
    else:
        raise AssertionError("the workload did not finish")
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.pinned
    return results


def assert_same(
    sync: dict[str, Result], overlapped: dict[str, Result], cached: bool = False, logprob_tol: float = 0.0
) -> None:
    """Tokens, finish reasons and counts exactly; logprobs exactly, or within `logprob_tol` where a
    preemption recomputed the KV at another step than the synchronous engine did (a prompt-sized
    recompute rounds differently from the decode steps it replaces)."""
    for rid, want in sync.items():
        got = overlapped[rid]
        assert got.tokens == want.tokens, rid
        assert got.logprobs == pytest.approx(want.logprobs, abs=logprob_tol, rel=0), rid
        assert got.finish_reason == want.finish_reason, rid
        assert (got.num_prompt_tokens, got.num_output_tokens) == (
            want.num_prompt_tokens,
            want.num_output_tokens,
        ), rid
        if cached:
            assert got.num_cached_tokens == want.num_cached_tokens, rid


def tiny_config(**overrides) -> EngineConfig:
    base = EngineConfig(
        dtype="float32",
        kv_cache_bytes=2**20,
        block_size=4,
        attention_backend="torch",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enforce_eager=True,
        num_threads=1,
        num_speculative_tokens=0,  # one token per step (drafts: tests/test_speculative.py)
    )
    return dataclasses.replace(base, **overrides)


def sync_and_async(config: EngineConfig, requests: list[Request]) -> tuple[LLMEngine, dict, dict]:
    """Both engines over one runner (the same weights); returns the async engine and both results."""
    runner = tiny_runner(config)
    sync = run(LLMEngine(config, runner=runner), requests)
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=runner)
    try:
        overlapped = run(engine, requests)
    finally:
        engine.close()
    assert not runner.sampler.generators, "a finished request's generator was not released"
    return engine, sync, overlapped


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_sync(seed):
    """A pool roomy enough that nothing is preempted: most steps overlap."""
    requests = random_workload(seed)
    engine, sync, overlapped = sync_and_async(tiny_config(num_kv_blocks=128), requests)
    assert_same(sync, overlapped)
    stats = engine.stats()
    assert stats.num_overlapped_steps > stats.num_sync_steps > 0
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("seed", range(6))
def test_small_pool_preempts_and_matches_sync(seed):
    """A pool of 14 blocks (56 tokens) for up to 4 sequences: preemption, by plans made while a step
    is in flight (its sequences among the victims), so the steps overlap through it."""
    requests = random_workload(100 + seed)
    engine, sync, overlapped = sync_and_async(
        tiny_config(num_kv_blocks=14, enable_prefix_caching=seed % 2 == 0), requests
    )
    assert_same(sync, overlapped, logprob_tol=1e-5)
    assert engine.scheduler.num_preemptions > 0 and engine.fallbacks["preemption"] == 0
    # One synchronous step, the first (nothing running then): every preemption was planned in flight.
    assert engine.stats().num_sync_steps == 1 and engine.stats().num_overlapped_steps > 20


@pytest.mark.parametrize("seed", [200, 201, 203])
def test_penalties_overlap_and_match_sync(seed):
    """Penalties read token statistics kept on the device (not the host history, which holds the
    placeholder): their steps overlap like any other."""
    requests = random_workload(seed, penalties=True)
    assert any(r.sampling.needs_history for r in requests)
    engine, sync, overlapped = sync_and_async(tiny_config(num_kv_blocks=128), requests)
    assert_same(sync, overlapped)
    assert engine.stats().num_overlapped_steps > engine.stats().num_sync_steps
    assert not engine.runner.sampler.penalties, "a finished request's penalty row was not released"


def test_prefix_hits_and_usage_counts_match_sync():
    """Requests sharing a 24-token prefix arrive one after another has finished: the same cached
    token counts as the synchronous engine, and the hits are real."""
    rng = random.Random(7)
    shared = [rng.randrange(TINY.vocab_size) for _ in range(24)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [
        Request(f"p{i}", shared + [rng.randrange(TINY.vocab_size)] * (i + 1), sp, 12 * i, None)
        for i in range(4)
    ]
    engine, sync, overlapped = sync_and_async(tiny_config(num_kv_blocks=64), requests)
    assert_same(sync, overlapped, cached=True)
    assert all(overlapped[f"p{i}"].num_cached_tokens == 24 for i in range(1, 4))
    assert engine.stats().num_prefix_hits == 3 * 24
    assert engine.stats().num_overlapped_steps > 0


def test_abort_in_flight_frees_blocks_at_once():
    """An abort lands while the step that holds the sequence is in flight: its blocks go back at
    once (that step's KV write comes before any later step's, queued behind it); its token is
    dropped when the step returns."""
    config = tiny_config(num_kv_blocks=64, async_scheduling=True)
    engine = LLMEngine(config, runner=tiny_runner(config))
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", list(range(10, 20)), sp)
    engine.add_request("b", list(range(20, 26)), sp)
    tokens = []
    for _ in range(4):
        tokens += [o.new_token_ids for o in engine.step() if o.request_id == "a"]
    assert engine.has_in_flight
    seq = engine.scheduler.requests["a"]
    held = len(seq.block_table)
    free_before = engine.block_manager.num_free_blocks
    assert engine.abort("a") and seq in engine.scheduler.pinned
    assert engine.block_manager.num_free_blocks == free_before + held
    outputs = engine.step()
    [a] = [o for o in outputs if o.request_id == "a"]
    assert a.finished and a.finish_reason is FinishReason.ABORT and a.new_token_ids == []
    assert a.num_output_tokens == sum(len(t) for t in tokens)
    assert engine.block_manager.num_free_blocks >= free_before + held - 1  # b may take one
    engine.abort("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_step_failure_rolls_back_to_the_last_committed_step():
    """A step that raises undoes every launched plan: placeholders gone, computed counts as
    committed, and the engine goes on to the same tokens as before."""
    config = tiny_config(num_kv_blocks=64, async_scheduling=True)
    runner = tiny_runner(config)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLMEngine(dataclasses.replace(config, async_scheduling=False), runner=runner).generate(
        [list(range(5, 17))], sp
    )
    engine = LLMEngine(config, runner=runner)
    engine.add_request("x", list(range(5, 17)), sp)
    tokens = []
    for _ in range(3):
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    real_launch, calls = runner.launch, []

    def failing_launch(plan, *args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_launch(plan, *args)

    runner.launch = failing_launch
    try:
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(2):  # the step in flight returns; the one launched with it fails
                tokens += [t for o in engine.step() for t in o.new_token_ids]
        seq = engine.scheduler.requests["x"]
        assert seq.num_placeholders == 0 and seq.num_computed_tokens == seq.num_tokens - 1
        engine.scheduler.check_integrity()
        while engine.has_unfinished_requests():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
    finally:
        runner.launch = real_launch
        engine.close()
    assert tokens == want[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_is_not_computed_past():
    """A sequence whose pending token is its last (max_tokens) is left out of the next plan: no
    step is wasted on it, so max_tokens=1 requests never overlap with themselves."""
    config = tiny_config(num_kv_blocks=64, async_scheduling=True)
    engine = LLMEngine(config, runner=tiny_runner(config))
    sp = SamplingParams(temperature=0, max_tokens=1)
    out = engine.generate([[5, 6, 7], [8, 9]], sp)
    assert [len(t) for t in out] == [1, 1]
    assert engine.num_steps == 1
    engine.close()


def test_smollm2_matches_sync(make_engine, tokenizer):
    """The embedded SmolLM2 (session runner): a chat-sized workload with arrivals, an abort, EOS and
    a small pool; the async engine gives the synchronous engine's tokens."""
    rng = random.Random(3)
    texts = [
        "The capital of France is",
        "Count from one to ten:",
        "Bees make",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colors are",
    ]
    requests = []
    for i, text in enumerate(texts):
        sp = (
            SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(4, 14))
            if i % 3 == 2
            else SamplingParams(temperature=0, max_tokens=rng.randint(4, 14))
        )
        abort_at = 3 if i == 1 else None
        requests.append(Request(f"s{i}", tokenizer.encode(text), sp, arrive_after=2 * i, abort_at=abort_at))
    kwargs = dict(num_kv_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    sync = run(make_engine(**kwargs), requests)
    engine = make_engine(async_scheduling=True, **kwargs)
    overlapped = run(engine, requests)
    engine.close()
    assert_same(sync, overlapped)
    assert sync["s1"].finish_reason is FinishReason.ABORT
    assert engine.stats().num_overlapped_steps > 0


def test_async_engine_streams_with_backpressure_match_sync():
    """Through AsyncEngine (the worker's loop thread) with a 2-output stream buffer and slow readers:
    parked sequences can finish from the step already in flight; every stream still gets the
    synchronous engine's tokens and the pool ends whole."""
    import asyncio

    from worker.async_engine import AsyncEngine

    config = tiny_config(num_kv_blocks=64)
    runner = tiny_runner(config)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (i + 1) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    want = LLMEngine(config, runner=runner).generate(prompts, params)

    engine = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=runner)
    served = AsyncEngine(engine, stream_buffer=2)
    served.start()

    async def consume(i: int) -> list[int]:
        tokens = []
        async for out in served.generate(f"s{i}", prompts[i], params[i]):
            tokens += out.new_token_ids
            await asyncio.sleep(0.01 * (i % 3))  # slow readers fill their buffers
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(consume(i) for i in range(5)))

    try:
        got = asyncio.run(main())
    finally:
        served.shutdown()
    assert got == want
    assert engine.stats().num_overlapped_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
