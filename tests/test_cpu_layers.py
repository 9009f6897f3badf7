"""The decoder layers of a CPU step as one C++ op (worker/kernels/cpu_layers.py) against the Python
layer loop it replaces (LlamaModel.forward with the "cpu" backend's fused ops): bit-identical hidden
states and KV caches on the embedded SmolLM2 in prefill, chunked prefill, decode and mixed steps on
every CPU path of the quantized linears, the engine's greedy tokens with the op on and off, which
models it declines (and why), and bad arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.config import EngineConfig
from worker.kernels import cpu_ext, cpu_quant
from worker.kernels.cpu_layers import CpuLayerStack

needs_op = pytest.mark.skipif(
    not cpu_ext.available(), reason="the llm_cpu extension did not build here (no compiler?)"
)
needs_vnni = pytest.mark.skipif(
    not (cpu_ext.available() and cpu_quant.vnni_available()),
    reason="no int8 dot products (AVX512-VNNI / AVX2) on this CPU or in its build: no W4A8 / W8A8 layers",
)

SMALL = dict(kv_cache_bytes=16 * 2**20, num_threads=2, max_num_seqs=8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bfloat16 bit patterns: NaN-safe exact equality


@pytest.mark.parametrize(
    "paths",
    [
        pytest.param({}, marks=needs_vnni, id="int8-activations"),
        pytest.param(dict(cpu_int8_activations=False), marks=needs_op, id="bf16-activations"),
        pytest.param(
            dict(cpu_int8_activations=False, int4_dequant_min_rows=8, int8_dequant_min_rows=8),
            marks=needs_op,
            id="bf16-dequantize-from-8-rows",
        ),
    ],
)
def test_hidden_states_and_caches_are_bit_identical_to_the_python_layer_loop(paths):
    """Every step of an engine run (two prompts prefilled in 48-token chunks, a third arriving while
    they decode: prefill, chunked prefill, decode and mixed steps) goes through the op and, on a copy
    of the caches taken before the step, through the Python layer loop: the hidden states and every
    cache byte agree. For each CPU path of the quantized linears: W4A8 / W8A8 (int8 activations),
    torch's int4 kernel (bfloat16 activations), and dequantize-then-GEMM from 8 rows (so that both
    sides of the threshold run)."""
    from worker.engine import LLMEngine

    _check_every_step(LLMEngine(EngineConfig(max_num_batched_tokens=48, **paths, **SMALL)), vocab=49000)


@pytest.mark.parametrize(
    "int8_activations",
    [pytest.param(True, marks=needs_vnni, id="int8-activations"), pytest.param(False, id="bf16-activations")],
)
@needs_op
def test_qwen2_layers_with_qkv_bias_are_bit_identical(tmp_path, int8_activations):
    """A tiny random Qwen2 (q/k/v bias) quantized to int4 at load: the op adds each bias as the
    modules do, the same bits as the Python loop."""
    from tests.tiny_llama import save_tiny
    from worker.engine import LLMEngine

    path, _ = save_tiny(tmp_path, "qwen2")
    config = EngineConfig(
        model=str(path), quantization="int4", cpu_int8_activations=int8_activations, max_num_batched_tokens=48
    )
    engine = LLMEngine(dataclasses.replace(config, kv_cache_bytes=2**20, num_threads=2))
    gen = torch.Generator().manual_seed(0)
    for layer in engine.runner.model.layers:  # transformers initialises biases to zero
        bias = layer.self_attn.qkv_proj.bias
        bias.copy_(torch.randn(bias.shape, generator=gen).to(bias.dtype))  # in place: the op holds it
    _check_every_step(engine, vocab=127)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("int8-w8a8", marks=needs_vnni),
        pytest.param("int8-bf16", marks=needs_op),
        pytest.param("int4-repeats", marks=needs_op),
    ],
)
def test_int8_linears_and_repeated_int4_halves_are_bit_identical(tmp_path, case):
    """The linear paths the embedded model does not use (its linears are all Q4_1): int8 weights
    (`--quantization int8`) as W8A8 and, with bfloat16 activations, through torch's int8 kernel and
    the tiled dequantization from 8 rows; and int4 weights stored as two halves whose products add
    (`input_repeats=2`, how the GGUF loader keeps Q8_0), through torch's int4 kernel and
    dequantize-then-GEMM from 8 rows. On a tiny random Llama 3 (RoPE scaling)."""
    from tests.tiny_llama import save_tiny
    from worker.engine import LLMEngine
    from worker.model.gguf_quant import quantize_int4
    from worker.model.quant import Int4Linear, Int8Linear

    path, _ = save_tiny(tmp_path, "llama3")
    quant = "int8" if case.startswith("int8") else "int4"
    config = EngineConfig(
        model=str(path),
        quantization=quant,
        cpu_int8_activations=case == "int8-w8a8",
        int8_dequant_min_rows=8,
        max_num_batched_tokens=48,
    )
    engine = LLMEngine(dataclasses.replace(config, kv_cache_bytes=2**20, num_threads=2))
    runner = engine.runner
    kind = Int8Linear if quant == "int8" else Int4Linear
    linears = [m for layer in runner.model.layers for m in layer.modules() if isinstance(m, kind)]
    assert len(linears) == 4 * len(runner.model.layers)
    if case == "int4-repeats":
        for layer in runner.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, module in list(parent.named_children()):
                    if isinstance(module, Int4Linear):
                        w = module.dequantize()
                        halves = torch.cat([w * 0.75, w * 0.25], dim=1)  # the two halves' products add
                        twin = Int4Linear(*quantize_int4(halves, 32), input_repeats=2)
                        twin.dequant_min_rows = 8
                        setattr(parent, name, twin)
        runner.cpu_layers, why = CpuLayerStack.build(runner.model, runner.backend, runner.kv_caches)
        assert why == ""
    _check_every_step(engine, vocab=127)


def _check_every_step(engine, vocab: int) -> None:
    from worker.types import SamplingParams

    runner = engine.runner
    stack = runner.cpu_layers
    assert stack is not None
    kinds = []

    def checked(input_ids, positions, meta):
        copies = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        want = runner.model(input_ids, positions, copies, meta, runner.backend)
        got = CpuLayerStack.__call__(stack, input_ids, positions, meta)
        assert torch.equal(_bits(got), _bits(want))
        for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, copies):
            assert torch.equal(_bits(k), _bits(k_ref)) and torch.equal(_bits(v), _bits(v_ref))
        lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        kinds.append("decode" if max(lens) == 1 else "mixed" if min(lens) == 1 else "prefill")
        return got

    runner.cpu_layers = checked
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [(7 * j + 3) % vocab for j in range(70)], sp)
    engine.add_request("b", [(11 * j + 5) % vocab for j in range(23)], sp)
    for _ in range(4):
        engine.step()
    engine.add_request("c", [(13 * j + 1) % vocab for j in range(30)], sp)
    while engine.has_unfinished_requests():
        engine.step()
    assert {"prefill", "decode", "mixed"} <= set(kinds)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@needs_op
def test_greedy_tokens_with_and_without_the_op_are_the_same():
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    def tokens(flag: bool) -> dict[str, list[int]]:
        engine = LLMEngine(EngineConfig(cpu_layer_op=flag, **SMALL))
        assert (engine.runner.cpu_layers is not None) == flag
        sp = SamplingParams(temperature=0, max_tokens=12)
        for i, n in enumerate((5, 40, 17)):
            engine.add_request(f"r{i}", [(100 + 3 * i + j) % 49000 for j in range(n)], sp)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    on = tokens(True)
    assert on == tokens(False) and all(len(v) >= 1 for v in on.values())


@needs_op
def test_models_off_the_ops_path_keep_the_python_loop_and_say_why():
    from worker.model_runner import ModelRunner

    cases = [
        (dict(dense_weights_min_rows=16), "with a dense copy"),
        (dict(dtype="float16", quantization="none"), "float16 activations"),
        (dict(attention_backend="torch"), "'torch' attention backend"),
    ]
    for overrides, reason in cases:
        runner = ModelRunner(EngineConfig(**{**SMALL, **overrides}))
        assert runner.cpu_layers is None
        stack, why = CpuLayerStack.build(runner.model, runner.backend, runner.kv_caches)
        assert stack is None and reason in why, (overrides, why)
    # Tensor parallel's rank-0 model wraps the shard (its forward first hands the step to the other
    # ranks): declined even if the shard inside were on the op's path.
    from worker.tp.runner import LeaderModel

    runner = ModelRunner(EngineConfig(**SMALL))
    assert runner.cpu_layers is not None
    stack, why = CpuLayerStack.build(LeaderModel(runner.model, None), runner.backend, runner.kv_caches)
    assert stack is None and "LeaderModel" in why


@needs_op
def test_bad_arguments_are_value_errors_naming_the_problem():
    from worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(**SMALL))
    stack = runner.cpu_layers
    x = torch.zeros(1, runner.model_config.hidden_size, dtype=torch.bfloat16)
    args = dict(
        x=x,
        positions=torch.zeros(1, dtype=torch.int64),
        k_caches=stack.k_caches,
        v_caches=stack.v_caches,
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.ones(1, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        cos=stack.rope.cos,
        sin=stack.rope.sin,
        weights=stack.weights,
        eps=stack.eps,
        scale=stack.scale,
        num_heads=stack.shape[0],
        num_kv_heads=stack.shape[1],
        head_dim=stack.shape[2],
        sdpa_min_query_len=0,
        lora=[],
        lora_rows=[],
    )
    op = torch.ops.llm_cpu.decoder_layers
    h, residual = op(**args)  # well-formed: one token at position 0
    assert h.shape == residual.shape == x.shape
    with pytest.raises(ValueError, match="weight tensors"):
        op(**{**args, "weights": stack.weights[:-1]})
    with pytest.raises(ValueError, match="non-empty"):
        op(**{**args, "x": x[:0]})
    with pytest.raises(ValueError, match="LoRA tensors for 1 adapters"):
        op(**{**args, "lora_rows": [torch.tensor([0])]})
    with pytest.raises(ValueError, match="outside"):
        op(**{**args, "slot_mapping": torch.tensor([10**9])})
