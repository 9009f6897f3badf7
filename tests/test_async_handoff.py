"""Async scheduling's device hand-off (worker/model_runner.py `launch`, worker/input_batch.py
`feed`): step N+1 reads the tokens step N sampled from N's token tensor, not from the host.

The executor thread never writes a sampled token into a sequence (only the engine thread does, when
it commits), and `InputBatch.build` puts 0 in the host ids where a token is fed, so a hand-off that
read the wrong row, or none, changes the tokens and fails the comparison with the synchronous
engine. Each path the runner can take is run on CPU: the host inputs as they are (`mirror=False`,
the CPU engine), the staged single transfer with the scatter on the "device" (`mirror=True`, the
CUDA code path), and the decode-graph path (the static forward standing in for each replay, the
scatter into the graph's static input row), with a mixed step (prompt chunks + decode graph).
Also AsyncEngine's backpressure when a parked sequence finishes from the step in flight, driven step
by step (the AsyncEngine test in tests/test_async_scheduling.py reaches that case only by timing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_async_scheduling import assert_same, random_workload, run, tiny_config, tiny_runner
from worker.cuda_graphs import CudaGraphRunner, capture_sizes
from worker.engine import LLMEngine
from worker.input_batch import InputBatch
from worker.scheduler import ScheduledSeq, SchedulerOutput
from worker.sequence import PLACEHOLDER, Sequence
from worker.types import SamplingParams


def with_path(runner, path: str) -> None:
    batch = runner.input_batch
    if path in ("mirror", "graphs"):
        runner.input_batch = InputBatch(
            batch.max_rows, batch.max_blocks, batch.block_size, batch.device, mirror=True
        )
    if path == "graphs":
        graphs = CudaGraphRunner(
            runner.model,
            runner.kv_caches,
            runner.backend,
            capture_sizes(runner.config.max_num_seqs),
            runner.input_batch,
        )
        graphs.eager_replay = True
        runner.cuda_graphs = graphs


@pytest.mark.parametrize("path", ["host", "mirror", "graphs"])
@pytest.mark.parametrize("seed", [0, 3])
def test_tokens_handed_off_on_the_device_match_sync(path, seed):
    config = tiny_config(num_kv_blocks=128)
    requests = random_workload(seed)
    runner = tiny_runner(config)
    with_path(runner, path)
    sync = run(LLMEngine(config, runner=runner), requests)
    fed, mixed = [], []
    build = runner.input_batch.build

    def counting_build(plan, live=None, feed=None):
        step = build(plan, live, feed)
        fed.append(step.feed[0].shape[0])
        assert (step.ids[step.feed[0]] == 0).all(), "a fed token's host id is read"
        return step

    runner.input_batch.build = counting_build
    if runner.cuda_graphs is not None:
        graph_run = runner.cuda_graphs.run

        def counting_run(step, size, tokens=None):
            mixed.append(bool(len(step.feed[0])))
            return graph_run(step, size, tokens)

        runner.cuda_graphs.run = counting_run
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=runner)
    try:
        overlapped = run(engine, requests)
    finally:
        engine.close()
    assert_same(sync, overlapped)
    assert engine.stats().num_overlapped_steps > 0
    assert sum(fed) > 0, "no step read its input token from the previous step's tokens"
    if path == "graphs":
        assert any(mixed), "no decode graph was fed on the device"


def test_feed_reads_the_row_of_each_request():
    """build + eager_inputs with a feed map: each fed id is its own request's row of `prev`."""
    batch = InputBatch(4, 4, 4, torch.device("cpu"), mirror=True)
    seqs = []
    for i, n in enumerate((5, 9, 3)):
        seq = Sequence(f"s{i}", list(range(10 * i, 10 * i + n)), SamplingParams(temperature=0))
        seq.token_ids.append(PLACEHOLDER)
        seq.block_table = [4 * i + b for b in range(-(-(n + 1) // 4))]
        seq.num_computed_tokens = n
        seqs.append(seq)
    plan = SchedulerOutput([ScheduledSeq(s, 1) for s in seqs])
    prev = torch.tensor([71, 70, 72])  # rows: s1, s0, s2
    step = batch.build(plan, feed={"s0": 1, "s1": 0, "s2": 2})
    ids, positions, _ = batch.eager_inputs(step, prev)
    assert ids.tolist() == [70, 71, 72]
    assert positions.tolist() == [5, 9, 3]
    with pytest.raises(AssertionError, match="previous step's tokens"):
        batch.eager_inputs(batch.build(plan, feed={"s0": 1}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts the executor's host syncs")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_the_executor_queues_steps_without_a_host_sync(enforce_eager):
    """With async scheduling the executor thread must never wait for the device: every step it
    launches runs under torch.cuda.set_sync_debug_mode("error"), which raises on any implicit
    synchronization (.item(), .tolist(), a copy from pageable memory...). Greedy, sampled (fused
    kernel), logit-bias and penalty rows; no logprobs (their values come back to the host by design)."""
    config = tiny_config(
        num_kv_blocks=128, device="cuda", attention_backend="triton", enforce_eager=enforce_eager
    )
    runner = tiny_runner(config)
    launch = runner.launch

    def guarded(plan, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = guarded
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, logit_bias=((5, 2.0),), seed=4, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=10, ignore_eos=True),
    ]
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (i + 2) for i in range(4)]
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=runner)
    try:
        out = engine.generate(prompts, params)
    finally:
        engine.close()
    assert [len(t) for t in out] == [9, 12, 7, 10]
    assert engine.stats().num_overlapped_steps > 0


def test_a_parked_sequence_that_finishes_from_the_step_in_flight_is_not_rescheduled():
    """AsyncEngine's backpressure with async scheduling, step by step on this thread (no timing):
    a sequence is parked (its reader's buffer is full) while the step holding its last token is in
    flight; that step finishes it, and unparking must not put the finished sequence back into the
    running queue (it would be scheduled again) nor leak its slot or blocks."""
    from types import SimpleNamespace

    from worker.async_engine import AsyncEngine

    config = dataclasses.replace(tiny_config(num_kv_blocks=64), async_scheduling=True)
    engine = LLMEngine(config, runner=tiny_runner(config))
    served = AsyncEngine(engine, stream_buffer=1)  # its loop thread is never started here
    engine.add_request("x", [5, 9, 11, 4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    try:
        first = engine.step()  # the prefill returns token 1; the decode of token 2 is in flight
        assert [o.new_token_ids for o in first if o.request_id == "x"] != [[]]
        assert engine.has_in_flight
        served._streams["x"] = SimpleNamespace(full=True, paused=False)  # the reader is behind
        max_seqs = engine.scheduler.max_num_seqs
        parked = served._park()
        assert [s.request_id for s in parked.running] == ["x"] and not engine.scheduler.running
        outputs = engine.step()  # nothing new to plan; the step in flight finishes "x"
        served._unpark(parked)
    finally:
        engine.close()
    [out] = [o for o in outputs if o.request_id == "x"]
    assert out.finished and out.num_output_tokens == 2
    assert not engine.scheduler.running and not engine.has_unfinished_requests()
    assert engine.scheduler.max_num_seqs == max_seqs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_load_report_includes_the_step_whose_token_a_reader_gets(monkeypatch):
    """AsyncEngine refreshes its load report (`stats()`, what GetLoad serves the router) before it
    hands a step's outputs to the streams: a client that has its first token and then reads the load
    must not see its request still waiting (a stale report made tests/test_faults.py's hung-worker
    count flaky)."""
    import asyncio

    from worker import async_engine

    config = tiny_config(num_kv_blocks=64)
    served = async_engine.AsyncEngine(LLMEngine(config, runner=tiny_runner(config)))
    waiting_at_put = []
    take = async_engine._Stream.take  # the engine thread hands each output over through it

    def recording_take(stream, item):
        waiting_at_put.append(served.stats().num_waiting)
        return take(stream, item)

    monkeypatch.setattr(async_engine._Stream, "take", recording_take)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main() -> list[int]:
        return [t async for out in served.generate("x", [5, 9, 11, 4], sp) for t in out.new_token_ids]

    served.start()
    try:
        assert len(asyncio.run(main())) == 3
    finally:
        served.shutdown()
    assert waiting_at_put and set(waiting_at_put) == {0}, waiting_at_put
