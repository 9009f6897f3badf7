"""RequestSampler (worker/sampler.py): per-row paths, per-request state, and the fused Triton kernel
(worker/kernels/triton_sampling.py) inside the engine.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
forced on with `RequestSampler.fused = fused_sample` (the runner turns it on by itself on CUDA only);
on a CUDA machine the same tests run on the GPU (the tiny engines' device is `auto`).
- Row by row: fused rows get exactly `reference_fused_sample` over the same row's logits with the
  kernel's own Philox draws (`philox_noise` at the request's seed and its count of sampled tokens),
  the count moving on by one per call; torch-path rows (logprobs, logit bias, penalties) get
  `sample_tokens`' tokens with the request's generator; logprobs only where asked.
- In the engine: a seeded request's tokens do not depend on what else is in the batch; async
  scheduling gives the synchronous engine's tokens with the fused path on; nothing leaks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from tests.test_async_scheduling import tiny_config, tiny_runner
from worker.engine import LLMEngine
from worker.kernels.triton_sampling import fused_sample, philox_noise, reference_fused_sample
from worker.sampler import RequestSampler
from worker.sampling_ops import sample_tokens
from worker.types import SamplingParams

VOCAB = 64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seq(rid: str, **params) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, sampling=SamplingParams(**params), prompt_token_ids=[1, 2, 3])


def reference_rows(logits, seqs, seeds, offsets):
    params = [s.sampling for s in seqs]
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    seeds = as_tensor(seeds, torch.int64)
    noise = philox_noise(seeds, as_tensor(offsets, torch.int64), logits.shape[-1])
    return reference_fused_sample(
        logits,
        as_tensor([p.temperature for p in params], torch.float32),
        as_tensor([p.top_k for p in params], torch.int32),
        as_tensor([p.top_p for p in params], torch.float32),
        as_tensor([p.min_p for p in params], torch.float32),
        noise,
    )


def test_rows_take_their_path_and_match_their_reference():
    sampler = RequestSampler(DEVICE, seed=0, fused=fused_sample)
    seqs = [
        seq("t", temperature=0.8, top_p=0.9, seed=11),
        seq("g", temperature=0),  # greedy: the kernel's argmax
        seq("lp", temperature=0.7, seed=5, logprobs=True),  # torch path
        seq("k", temperature=1.2, top_k=5, min_p=0.05, seed=2**64 - 12),  # a uint64 seed past int64
        seq("pen", temperature=0, presence_penalty=1.5),  # torch path, penalty statistics
    ]
    fused_rows = [0, 1, 3]
    lp_gen = torch.Generator(device=DEVICE).manual_seed(5)  # what the sampler's generator for "lp" must draw
    pen_output: list[int] = []
    rng = torch.Generator().manual_seed(3)
    for step in range(4):
        logits = (torch.randn(len(seqs), VOCAB, generator=rng) * 3).to(DEVICE, torch.bfloat16)
        tokens = sampler.sample(seqs, lambda upcast, x=logits: x.float() if upcast else x).to_host()
        fused = [seqs[i] for i in fused_rows]
        seeds = [sampler.philox[s.request_id][0] for s in fused]  # "g" is unseeded: drawn
        assert seeds[0] == 11 and seeds[2] == -12  # the same 64 bits as an int64
        want = reference_rows(logits[fused_rows], fused, seeds, [step] * 3)
        assert [tokens[seqs[i].request_id][0] for i in fused_rows] == want.tolist()
        assert tokens["g"][0] == int(logits[1].float().argmax())
        lp, _ = sample_tokens(logits[2:3].float(), [seqs[2].sampling], [lp_gen])
        assert tokens["lp"][0] == int(lp[0])
        history = [([1, 2, 3], [1, 2, 3] + pen_output)]
        pen, _ = sample_tokens(logits[4:5].float(), [seqs[4].sampling], [None], history)
        assert tokens["pen"][0] == int(pen[0])
        pen_output.append(int(pen[0]))
        assert [tokens[seqs[i].request_id][1] is None for i in range(5)] == [True, True, False, True, True]
        assert all(sampler.philox[seqs[i].request_id][1] == step + 1 for i in fused_rows)
        assert set(sampler.generators) == {"lp"} and set(sampler.penalties) == {"pen"}
    for s in seqs:
        sampler.release(s.request_id)
    assert not (sampler.philox or sampler.generators or sampler.penalties)


def test_seeded_tokens_do_not_depend_on_the_batch():
    config = tiny_config(num_kv_blocks=128)
    runner = tiny_runner(config)
    runner.sampler.fused = fused_sample
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = LLMEngine(config, runner=runner).generate([[5, 6, 7, 8]], sp)[0]
    others = [SamplingParams(temperature=0.9, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)]
    batch = LLMEngine(config, runner=runner).generate(
        [[9, 10], [5, 6, 7, 8], [11] * 9, [3, 4]], [others[0], sp, others[1], others[2]]
    )
    assert batch[1] == alone
    assert len(set(map(tuple, batch))) > 1, "seeds drew the same tokens: the seed is not read"
    assert not runner.sampler.philox


def test_async_scheduling_with_the_fused_path_matches_sync():
    config = tiny_config(num_kv_blocks=128)
    runner = tiny_runner(config)
    runner.sampler.fused = fused_sample
    prompts = [[5 + i, 6, 7 + 2 * i] * (i + 1) for i in range(6)]
    params = [
        SamplingParams(temperature=0.8, top_k=8, seed=i, max_tokens=6 + i, ignore_eos=True)
        if i % 3
        else SamplingParams(temperature=0, logprobs=True, max_tokens=7)
        for i in range(6)
    ]
    want = LLMEngine(config, runner=runner).generate(prompts, params)
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=True), runner=runner)
    try:
        got = engine.generate(prompts, params)
    finally:
        engine.close()
    assert got == want
    assert engine.stats().num_overlapped_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not (runner.sampler.philox or runner.sampler.generators)
