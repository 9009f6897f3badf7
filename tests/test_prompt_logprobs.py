"""Prompt logprobs (`SamplingParams.prompt_logprobs`): how likely the model finds each prompt token.

Against transformers' log-softmax of the same tiny random checkpoint: prompts prefilled in chunks,
the synchronous and the async engine, a prompt whose blocks are in the prefix cache (it is computed
again, not served from the cache), top-N entries, one- and two-token prompts, requests mixed with
plain ones. Preemption (a small KV pool) recomputes prompts without adding entries twice. With the
decode graph path (the CPU stand-in for CUDA graphs) the steps that score a prompt run eager and
give the eager runner's values. On the served default (SmolLM2 Q4_1 through the C++ layer op, int8
activations): teacher forcing agrees with generation, the check lm-evaluation-harness makes
(tokens a greedy generation chose are each the most likely at their position, with the logprob
the generation reported).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_llama import arrivals_on_graphs_and_eager, save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.types import Logprob, SamplingParams

PROMPTS = [
    [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19] * 2,  # 38: several chunks
    [44, 12],
    [3] * 37,
    [120],
    [120, 110, 100, 90, 80, 70, 60],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = save_tiny(tmp_path_factory.mktemp("tiny"), "llama3")
    return path, hf.eval()


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position but the last, (P - 1, V)."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Every request to the end: {id: {"tokens", "logprobs", "prompt" (each output's prompt
    logprobs, in order), "cached"}}."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    out = {rid: {"tokens": [], "logprobs": [], "prompt": [], "cached": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            r = out[o.request_id]
            r["tokens"] += o.new_token_ids
            r["logprobs"] += o.new_logprobs or []
            r["cached"] = o.num_cached_tokens
            if o.prompt_logprobs is not None:
                r["prompt"].append(list(o.prompt_logprobs))
    return out


def check_against(ref: torch.Tensor, prompt: list[int], entries: list[float], top: int) -> None:
    assert len(entries) == len(prompt) - 1
    if not entries:
        return
    expected = ref[torch.arange(len(entries)), torch.tensor(prompt[1:])]
    got = torch.tensor([float(e) for e in entries])
    assert float((got - expected).abs().max()) <= 1e-4
    for position, entry in enumerate(entries):
        assert isinstance(entry, Logprob) == bool(top)
        if top:
            ids = [t for t, _ in entry.top]
            values = torch.tensor([v for _, v in entry.top])
            ref_values, ref_ids = ref[position].topk(top)
            assert ids == ref_ids.tolist()
            assert float((values - ref_values).abs().max()) <= 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_transformers(tiny, async_scheduling):
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
    # The first prompt's full blocks go into the prefix cache; scoring it must compute them again.
    warm = run(engine, {"warm": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))})
    again = run(engine, {"again": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))})
    assert warm["warm"]["cached"] == 0 and again["again"]["cached"] == 32  # the cache works
    tops = [3, 0, 5, 2, 1]
    requests = {
        f"p{i}": (prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=top))
        for i, (prompt, top) in enumerate(zip(PROMPTS, tops))
    }
    requests["plain"] = (PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    queries = engine.block_manager.num_prefix_queries
    out = run(engine, requests)
    assert engine.block_manager.num_prefix_queries - queries == len(PROMPTS[2])  # scored: no lookup
    assert out["plain"]["prompt"] == []  # not asked for: never sent
    assert out["plain"]["cached"] == 32  # its prefix hits the blocks the scored one wrote
    for i, (prompt, top) in enumerate(zip(PROMPTS, tops)):
        r = out[f"p{i}"]
        assert r["cached"] == 0
        assert len(r["prompt"]) == 1, "sent once, with the first tokens"
        check_against(reference(hf, prompt), prompt, r["prompt"][0], top)
    assert out["p2"]["tokens"] == out["plain"]["tokens"]  # scoring leaves the output unchanged
    engine.scheduler.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_recomputes_without_adding_twice(tiny, async_scheduling):
    path, hf = tiny
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        kv_cache_bytes=2**20,
        num_kv_blocks=8,  # 128 slots for four requests of up to 38 + 30 tokens
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0][5:], PROMPTS[4] * 4]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    out = run(engine, {f"r{i}": (p, sp) for i, p in enumerate(prompts)})
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        [entries] = out[f"r{i}"]["prompt"]
        check_against(reference(hf, prompt), prompt, entries, 2)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_graph_path_scores_prompts_eagerly():
    """The decode-graph runner (its CPU stand-in) with arrivals joining running decodes: steps that
    score a prompt chunk leave the graph path, and tokens and prompt logprobs equal the eager
    runner's."""
    prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((19, 2, 37, 7, 11, 5))]

    def params_for(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=None if i % 2 else 2
        )

    def read(record: dict, output) -> None:
        if output.prompt_logprobs is not None:
            record["prompt"] = [(float(e), e.top) for e in output.prompt_logprobs]

    results = arrivals_on_graphs_and_eager(prompts, params_for, read)
    eager, graphs = results[False], results[True]
    for i, prompt in enumerate(prompts):
        got, want = graphs[f"r{i}"].get("prompt"), eager[f"r{i}"].get("prompt")
        if i % 2:
            assert got is None and want is None
            continue
        assert len(got) == len(prompt) - 1 and got == want  # the same eager computation


def test_served_default_teacher_forcing_agrees_with_generation():
    """The served default path (Q4_1 int4 weights, int8 activations, the C++ layer op): score the
    prompt + a greedy continuation; each continuation token is the most likely at its position (so
    lm-evaluation-harness's is_greedy holds) and its prompt logprob is the one the generation
    reported."""
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20, num_threads=1))
    tokenizer = Tokenizer.from_model(default_model_path())
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of Germany?"}])
    gen = run(
        engine, {"gen": (prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True))}
    )["gen"]
    full = prompt + gen["tokens"][:-1]
    scored = run(engine, {"score": (full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))})
    [entries] = scored["score"]["prompt"]
    tail = entries[len(prompt) - 1 :]
    assert len(tail) == len(gen["tokens"]) - 1
    for token, entry, lp in zip(gen["tokens"], tail, gen["logprobs"]):
        [(top_id, top_value)] = entry.top
        assert top_id == token and top_value == float(entry)  # greedy: the token is the argmax
        assert abs(float(entry) - lp) <= 1e-3, (float(entry), lp)  # equal here (per-row int8 scales)
    engine.close()
