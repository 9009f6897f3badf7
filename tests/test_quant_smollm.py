"""The embedded SmolLM2 quantized at load (worker/model/loader.py, quantization "auto"): int4
linears + int8 embedding, weights <= 1.3x the file (tensor bytes, and RSS in a fresh process),
logits and teacher-forced greedy agreement vs the float32 model within margins of the measured
values, and the engine serving it end to end. The slow part of the quantization tests (two loads
of the model and a float32 reference); kernels: tests/test_quant.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.quant_helpers import (
    one_thread,  # noqa: F401 - autouse: one intra-op thread in this module
)
from worker.kernels import cpu_quant
from worker.model.cpu_paths import use_dequant_gemm
from worker.model.loader import load_model
from worker.model.quant import Int4Linear

# --- the embedded SmolLM2 ------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why 1 is not prime.",
]


@pytest.fixture(scope="module")
def smollm_quant():
    return load_model(None, "bfloat16", "cpu", quantization="auto")


def test_smollm2_weights_stay_in_stored_precision(smollm_quant):
    from common.model_files import default_model_path

    model = smollm_quant.model
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("Int4Linear") == 120 and kinds.count("Int8Embedding") == 1  # 210 Q4_1 tensors fused
    assert "Linear" not in kinds and model.lm_head is None and model.dtype == torch.bfloat16
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes <= 1.3 * default_model_path().stat().st_size  # measured 0.985x


def test_smollm2_load_resident_memory_in_a_fresh_process():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.quant_accuracy",
            "--measure-load",
            "bfloat16",
            "auto",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    m = json.loads(out.stdout.splitlines()[-1])
    # measured: resident 107-109 MiB, peak 125-129 MiB for a 93.8 MiB file (the old loader: 1,074 MiB peak)
    assert m["resident_mib"] <= 1.3 * m["file_mib"], m
    assert m["peak_mib"] <= 1.7 * m["file_mib"], m


@pytest.fixture(scope="module")
def smollm_float32():
    """The float32 reference on CPU (the shared `runner` fixture is on CUDA where there is one)."""
    return load_model(None, "float32", "cpu", quantization="none").model


@pytest.fixture(scope="module")
def smollm_reference(smollm_float32, tokenizer):
    """The float32 model's greedy continuations (32 tokens) of PROMPTS."""
    from benchmarks.quant_accuracy import Runner

    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = Runner(smollm_float32, max(map(len, prompts)) + 32, len(prompts))
    outputs = ref.greedy(prompts, 32)
    return prompts, outputs, ref.score(prompts, outputs)


def _assert_close_to_float32(model, smollm_reference) -> None:
    """Teacher-forced logits on the float32 model's tokens and free-running greedy tokens, held to
    one set of margins (every CPU path of the quantized model must meet them)."""
    from benchmarks.quant_accuracy import Runner, compare

    prompts, ref_tokens, ref_logits = smollm_reference
    runner = Runner(model, max(map(len, prompts)) + 32, len(prompts))
    res = compare(ref_logits, ref_tokens, runner.score(prompts, ref_tokens), runner.greedy(prompts, 32))
    assert res["logits_max_abs"] <= 3.0, res
    assert res["logits_mean_abs"] <= 0.35, res
    assert res["logits_max_rel"] <= 0.07, res
    assert res["teacher_forced_top1_agreement"] >= 0.9, res


def test_smollm2_quantized_logits_and_greedy_agree_with_float32(smollm_quant, smollm_reference):
    # measured on these 96 positions: max abs 1.26, mean abs 0.165, max rel 0.033, top-1 99.0%
    # (benchmarks/quant_accuracy.py, 20 prompts x 64 tokens: 1.91, 0.141, 0.051, 97.6%)
    _assert_close_to_float32(smollm_quant.model, smollm_reference)


def test_smollm2_dequantized_gemm_paths_agree_with_float32_as_closely(smollm_reference):
    """use_dequant_gemm (the CPU default with bfloat16 activations, from 32 / 16 rows), here from 2
    rows so that every forward of the comparison takes it: every int4 linear as one bfloat16 GEMM
    over its weight dequantized per call, the int8 lm_head over dequantized tiles. Held to the
    kernels' margins."""
    if not cpu_quant.available():
        pytest.skip("the llm_cpu extension is unavailable or torch packs int4 in another layout here")
    model = load_model(None, "bfloat16", "cpu", quantization="auto").model
    assert use_dequant_gemm(model, 2, 2) == 121
    # measured on these 96 positions: max abs 1.26, mean abs 0.159, max rel 0.033, top-1 96.9%
    # (the kernels, previous test: 1.26, 0.165, 0.033, 99.0%)
    _assert_close_to_float32(model, smollm_reference)


def test_smollm2_int8_activations_agree_with_float32(smollm_reference):
    """use_int8_activations (the CPU default where there is AVX512-VNNI): every int4 linear and the
    int8 lm_head multiply int8-rounded activations. A larger logit error than the bfloat16 kernels
    (the activations lose bits: llama.cpp's Q8 scheme), the same top-1 agreement."""
    from worker.model.cpu_paths import use_int8_activations

    if not cpu_quant.vnni_available():
        pytest.skip("no int8 dot products (AVX512-VNNI / AVX2) on this CPU or in its build: path unused")
    model = load_model(None, "bfloat16", "cpu", quantization="auto").model
    assert use_int8_activations(model) == 121
    # measured on these 96 positions: max abs 2.02, mean abs 0.247, max rel 0.053, top-1 97.9%
    _assert_close_to_float32(model, smollm_reference)


def test_engine_serves_the_quantized_model(smollm_float32, smollm_reference):
    """Quantization through EngineConfig: the engine's own logits (chunked prefill, paged decode)
    match the float32 model's on the engine's own tokens."""
    from benchmarks.quant_accuracy import Runner
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="bfloat16",
            quantization="auto",
            kv_cache_bytes=64 * 2**20,
            attention_backend="torch",
            num_threads=1,
            max_num_batched_tokens=7,
            num_speculative_tokens=0,  # one logits row per request per step
        )
    )
    assert sum(isinstance(m, Int4Linear) for m in engine.runner.model.modules()) == 120
    captured: dict[str, list[torch.Tensor]] = {}
    engine.runner.logits_observer = lambda rids, logits: [
        captured.setdefault(r, []).append(row.clone()) for r, row in zip(rids, logits)
    ]
    prompts = smollm_reference[0]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ours = [torch.stack(captured[r]) for r in sorted(captured)]
    ref = Runner(smollm_float32, max(map(len, prompts)) + 8, len(prompts)).score(prompts, outputs)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        assert float((o - r).abs().max() / r.abs().max()) <= 0.07  # measured 0.027-0.036
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
