"""CUDA graphs for decode (worker/cuda_graphs.py).

On CPU: batch-size buckets, the padding of a decode plan, and the static-buffer forward that a
graph records (padded to a bucket, stale block-table columns left from earlier steps) against the
plain eager forward, with padding rows leaving the KV cache untouched. On CUDA only: graph replay
against eager, logits and greedy tokens, through the whole engine.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_llama import TINY, record_graph_replays
from worker.config import EngineConfig
from worker.cuda_graphs import CudaGraphRunner, bucket_for, build_decode_inputs, capture_sizes, is_decode_only
from worker.engine import LLMEngine
from worker.input_batch import InputBatch
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.scheduler import ScheduledSeq, SchedulerOutput
from worker.sequence import Sequence
from worker.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tiny_model(device: str) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(TINY).to(device).eval()


def seq(request_id: str, num_tokens: int, num_computed: int, table: list[int]) -> Sequence:
    s = Sequence(request_id, list(range(10, 10 + num_tokens)), GREEDY)
    s.num_computed_tokens, s.block_table = num_computed, table
    return s


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 256 and len(sizes) == 20
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize(
    "num_seqs, expected", [(1, 1), (3, 4), (8, 8), (9, 16), (17, 32), (250, 256), (256, 256), (257, None)]
)
def test_bucket_for(num_seqs, expected):
    assert bucket_for(num_seqs, capture_sizes(256)) == expected


def test_decode_only():
    decode = ScheduledSeq(seq("a", 5, 4, [3]), 1)
    chunk = ScheduledSeq(seq("b", 9, 0, [4]), 4)
    assert is_decode_only(SchedulerOutput([decode]))
    assert not is_decode_only(SchedulerOutput([decode, chunk]))
    assert not is_decode_only(SchedulerOutput([]))


def test_build_decode_inputs_pads_rows():
    # Block size 4. "a" decodes position 5 (block 7, row 1); "b" computes the 1st token of a
    # 3-token prompt (a one-token chunk: it does not sample); "c" decodes position 8 (block 2, row 0).
    plan = SchedulerOutput(
        [
            ScheduledSeq(seq("a", 6, 5, [9, 7]), 1),
            ScheduledSeq(seq("b", 3, 0, [5]), 1),
            ScheduledSeq(seq("c", 9, 8, [1, 6, 2]), 1),
        ]
    )
    inputs = build_decode_inputs(plan, block_size=4, batch_size=4)
    assert inputs.tokens.tolist() == [
        [15, 10, 18, 0],  # input_ids; padding token 0
        [5, 0, 8, 0],  # positions
        [29, 20, 8, -1],
    ]  # slots; padding writes nothing
    assert inputs.seq_lens.tolist() == [6, 1, 9, 1]
    assert inputs.block_tables.tolist() == [[9, 7, 0], [5, 0, 0], [1, 6, 2], [0, 0, 0]]
    assert inputs.logits_rows == [0, 2]
    assert inputs.tokens.dtype == torch.int64 and inputs.seq_lens.dtype == torch.int32
    assert inputs.block_tables.dtype == torch.int32


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(),
                reason="runs on CPU tensors, which Triton only takes interpreted; on "
                "CUDA the replay test below checks the Triton path",
            ),
        ),
    ],
)
def test_static_forward_matches_eager(backend):
    """Every decode step through the static buffers (what a graph records) equals eager.

    Four requests of different lengths finish at different steps, so batches shrink (3 rows in a
    4-row bucket, 2 in 2, 1 in 1) and rows keep stale block-table columns from longer sequences.
    """
    config = EngineConfig(
        kv_cache_bytes=2**20,
        attention_backend=backend,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_speculative_tokens=0,  # decode steps of one token per sequence: the graphs' shape
    )
    runner = ModelRunner.from_model(config, tiny_model("cpu"))
    assert runner.cuda_graphs is None  # CPU: never captured
    engine = LLMEngine(config, runner=runner)
    graphs = CudaGraphRunner(
        runner.model, runner.kv_caches, runner.backend, capture_sizes(4), runner.input_batch
    )
    assert runner.input_batch.max_blocks == TINY.max_position // config.block_size
    prompts = [
        [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19],
        [44, 12],
        [3] * 37,
        [120, 110, 100, 90, 80, 70, 60],
    ]
    for i, (prompt, n) in enumerate(zip(prompts, (3, 9, 5, 12))):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    sizes_seen = []
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            plan = engine.scheduler.schedule()
            size = graphs.batch_size_for(plan)
            if size is not None:
                n = len(plan.scheduled)
                input_ids, positions, meta, _ = runner.prepare(plan)
                eager = runner.model(input_ids, positions, runner.kv_caches, meta, runner.backend)
                before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
                step = runner.input_batch.build(plan)
                runner.input_batch.load_graph_inputs(step, size, graphs.inputs)
                static = graphs.forward_static(size)
                assert static.shape == (size, TINY.hidden_size)
                torch.testing.assert_close(static[:n], eager, rtol=1e-5, atol=1e-5)
                # Only the real rows' slots may change (rewritten with the same K/V).
                written = meta.slot_mapping
                for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
                    for old, new in ((k0, k1), (v0, v1)):
                        old, new = old.flatten(0, 1), new.flatten(0, 1)
                        keep = torch.ones(old.shape[0], dtype=torch.bool)
                        keep[written] = False
                        # The pool is torch.empty: unwritten slots may hold NaN bit patterns.
                        torch.testing.assert_close(old[keep], new[keep], rtol=0, atol=0, equal_nan=True)
                        torch.testing.assert_close(new[written], old[written], rtol=1e-5, atol=1e-5)
                sizes_seen.append((n, size))
            engine.scheduler.update(plan, runner.run(plan))
    assert (3, 4) in sizes_seen and (2, 2) in sizes_seen and (1, 1) in sizes_seen
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefill_and_oversized_batches_run_eagerly():
    batch = InputBatch(2, 2, 4, torch.device("cpu"))
    graphs = CudaGraphRunner(tiny_model("cpu"), [], None, [1, 2], batch)
    decode = [ScheduledSeq(seq(f"s{i}", 5, 4, [i, i + 1]), 1) for i in range(3)]
    assert graphs.batch_size_for(SchedulerOutput(decode[:2])) == 2
    assert graphs.batch_size_for(SchedulerOutput(decode)) is None  # 3 > largest graph
    assert graphs.batch_size_for(SchedulerOutput([ScheduledSeq(seq("p", 9, 0, [1, 2, 3]), 9)])) is None
    too_long = ScheduledSeq(seq("l", 10, 9, [1, 2, 3]), 1)  # 3 blocks > 2
    assert graphs.batch_size_for(SchedulerOutput([too_long])) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_matches_eager_on_cuda():
    model = tiny_model("cuda")
    prompts = [
        [5, 9, 17, 33, 2, 8, 100, 41, 7, 3],
        [44, 12],
        [3] * 37,
        [120, 110, 100],
        [1, 2, 3, 4, 5, 6],
        [9] * 20,
    ]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 12, 5, 16, 9, 3)]
    results = {}
    for enforce_eager in (True, False):
        config = EngineConfig(
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.01,
            max_num_seqs=8,
            max_model_len=256,
            enforce_eager=enforce_eager,
        )
        runner = ModelRunner.from_model(config, model)
        assert (runner.cuda_graphs is None) == enforce_eager
        replays = []
        if runner.cuda_graphs is not None:
            assert runner.cuda_graphs.sizes == [1, 2, 4, 8]
            run = runner.cuda_graphs.run
            runner.cuda_graphs.run = lambda step, size, tokens=None: (
                replays.append(len(step.rows)),
                run(step, size, tokens),
            )[1]
        logits = {}
        runner.logits_observer = lambda ids, rows: [
            logits.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)
        ]
        tokens = LLMEngine(config, runner=runner).generate(prompts, params)
        results[enforce_eager] = tokens, {k: torch.stack(v) for k, v in logits.items()}
        if not enforce_eager:
            assert replays and set(replays) >= {6, 1}, replays  # 6 rows pad to 8; the tail alone
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = results[True], results[False]
    assert graph_tokens == eager_tokens
    assert eager_logits.keys() == graph_logits.keys()
    for rid, ref in eager_logits.items():
        err = float((graph_logits[rid] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-4, f"{rid}: max relative error {err:.2e}"


@pytest.mark.parametrize(
    "where",
    [
        "cpu-torch",
        pytest.param(
            "cpu-triton",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton takes CPU tensors only interpreted; see cuda"
            ),
        ),
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        ),
    ],
)
def test_runner_graph_path_with_mixed_steps_matches_eager(where):
    """The runner's graph path: decode-only steps in a bucket, mixed steps as one eager prompt-chunk
    launch plus the decode graph, staggered arrivals so most steps are mixed. Tokens equal the plain
    eager runner's. On CPU the static forward stands in for each replay; on CUDA graphs replay."""
    prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((19, 2, 37, 7, 11, 5))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 8, 5, 7)]
    device, _, backend = where.partition("-")
    results, kinds = {}, []
    for graphs_on in (False, True):
        if device == "cuda":
            config = EngineConfig(
                device="cuda",
                dtype="float32",
                gpu_memory_utilization=0.01,
                max_model_len=256,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                enforce_eager=not graphs_on,
            )
        else:
            config = EngineConfig(
                kv_cache_bytes=2**20,
                attention_backend=backend,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                num_speculative_tokens=0,  # as on CUDA, where drafts are off by default
            )
        runner = ModelRunner.from_model(config, tiny_model(device))
        if graphs_on:
            record_graph_replays(runner, kinds, stand_in=device != "cuda")
        engine = LLMEngine(config, runner=runner)
        schedule = engine.scheduler.schedule

        def record(schedule=schedule):
            plan = schedule()
            n_decode = sum(s.num_new_tokens == 1 for s in plan.scheduled)
            mixed.append(0 < n_decode < len(plan.scheduled))
            return plan

        engine.scheduler.schedule = record
        mixed = []
        out = {}
        pending = list(enumerate(zip(prompts, params)))
        with torch.inference_mode():
            while pending or engine.has_unfinished_requests():
                if pending:  # one arrival per step: prompt chunks keep joining running decodes
                    i, (prompt, sp) = pending.pop(0)
                    engine.add_request(f"r{i}", prompt, sp)
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        results[graphs_on] = out
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert results[True] == results[False]
    assert sum(mixed) >= 3 and len(kinds) > sum(mixed), (sum(mixed), len(kinds))  # mixed steps replayed
