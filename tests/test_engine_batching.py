"""Continuous batching on the real model: batched output == one-at-a-time output, token for token.

Acceptance 2 (first half): >= 8 concurrent greedy requests with different prompt and output
lengths equal each request run alone. Acceptance 4: with a pool too small for all at once,
preemption happens (counted) and the outputs still equal the unconstrained run.
"""

from __future__ import annotations

import pytest

from worker.types import FinishReason, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Count from one to five.",
    "Why is the sky blue? Answer in one sentence.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Write the word 'banana' backwards.",
    "Give me a short motivational quote about learning new things every day.",
    "What do bees make?",
    "Translate 'good night' to French.",
]
MAX_TOKENS = [12, 5, 20, 9, 16, 7, 14, 3, 10, 18]


@pytest.fixture(scope="module")
def requests(tokenizer):
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return prompts, params


@pytest.fixture(scope="module")
def alone(runner, requests):
    from worker.config import EngineConfig  # noqa: F401  (runner fixture carries the config)
    from worker.engine import LLMEngine

    engine = LLMEngine(runner.config, runner=runner)
    prompts, params = requests
    return [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]


def test_batched_equals_alone(make_engine, requests, alone):
    prompts, params = requests
    # A 64-token budget mixes prompt chunks with decodes of earlier requests in the same steps.
    engine = make_engine(max_num_batched_tokens=64)
    batched = engine.generate(prompts, params)
    assert [len(o) for o in batched] == MAX_TOKENS
    assert batched == alone
    assert engine.scheduler.num_preemptions == 0


def test_preemption_keeps_outputs_identical(make_engine, requests, alone):
    prompts, params = requests
    longest = max(len(p) + n for p, n in zip(prompts, MAX_TOKENS))
    # Room for about three requests at a time out of ten: preemption is unavoidable.
    num_blocks = 3 * (-(-longest // 16))
    engine = make_engine(num_kv_blocks=num_blocks, max_num_batched_tokens=256)
    out = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert out == alone


def test_stop_conditions(make_engine, requests, alone):
    prompts, _ = requests
    engine = make_engine()
    first = alone[0]
    stop_at = first[3]
    [out] = engine.generate(
        [prompts[0]], SamplingParams(temperature=0, max_tokens=50, stop_token_ids=(stop_at,), ignore_eos=True)
    )
    assert out == first[: first.index(stop_at) + 1]
    engine.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort("x")
    [final] = [o for o in engine.step() if o.request_id == "x"]
    assert final.finished and final.finish_reason is FinishReason.ABORT


def test_rejects_bad_requests(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="limit"):
        engine.add_request("c", [1] * (engine.info.max_model_len + 1), SamplingParams())
    engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=1))
    engine.abort("d")
    engine.step()
