"""LoRA rows beside the decode graphs (worker/model_runner.py `_forward`): in a step with adapter
rows, the base model's decode rows still replay their graph (captured without adapter deltas) and
the adapter rows, decoding or not, run in the step's eager launch with their deltas. Against the
eager runner, on the tiny float32 Llama with PEFT's own adapters (tests/test_lora.py): the same
tokens for every request, base and adapters mixed in most steps, and graphs replayed in steps that
carried adapter rows. On CPU the static forward stands in for each replay (tests/tiny_llama.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_lora import ADAPTERS, _peft_model
from tests.tiny_llama import record_graph_replays, save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-graphs")
    path, hf = save_tiny(root, "llama")
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        _peft_model(hf, settings, seed).save_pretrained(root / name)
    return path, root


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_base_rows_replay_graphs_beside_adapter_rows(checkpoint, async_scheduling):
    path, root = checkpoint
    prompts = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((19, 2, 37, 7, 11, 5, 9, 3))]
    names = ["", "wide", "", "narrow", "", "wide", "", ""]
    results, replays = {}, []  # per replay: whether its step carried adapter rows
    for graphs_on in (False, True):
        config = EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_bytes=2**20,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            num_speculative_tokens=0,  # as on CUDA, where drafts are off by default
            lora_modules=tuple(f"{name}={root / name}" for name in ADAPTERS),
            async_scheduling=async_scheduling,
        )
        runner = ModelRunner(config)
        kinds: list[int] = []
        if graphs_on:
            record_graph_replays(runner, kinds, stand_in=True)
            replay, forward, with_adapters = runner.cuda_graphs.run, runner._forward, [False]

            def run(step, size, tokens=None):
                assert not runner.adapters._step.rows, "a graph replayed with adapter deltas active"
                replays.append(with_adapters[0])
                return replay(step, size, tokens)

            def observed_forward(plan, *args, **kwargs):
                with_adapters[0] = any(s.seq.sampling.adapter for s in plan.scheduled)
                return forward(plan, *args, **kwargs)

            runner.cuda_graphs.run, runner._forward = run, observed_forward
        engine = LLMEngine(config, runner=runner)
        out: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        with torch.inference_mode():
            while pending or engine.has_unfinished_requests():
                if pending:  # one arrival per step: prompt chunks and adapter rows join running decodes
                    i, prompt = pending.pop(0)
                    sampling = SamplingParams(
                        temperature=0, max_tokens=5 + i % 4, ignore_eos=True, adapter=names[i]
                    )
                    engine.add_request(f"r{i}", prompt, sampling)
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        results[graphs_on] = out
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if graphs_on:
            assert kinds, "no decode step replayed a graph"
    assert results[True] == results[False]
    assert sum(replays) >= 3, replays  # base rows replayed their graph beside adapter rows
