"""The loader's quantized forms (worker/model/loader.py, worker/model/checkpoint.py) on small
checkpoints written here.

- A synthetic tiny llama GGUF with every supported family (Q4_0/Q4_1/Q4_K fused into one int4
  q|k|v, Q8_0, F16, F32, Q6_K): the header walk vs gguf.GGUFReader; each quantized module's weight
  equals the float32 load's within bfloat16 rounding of the scales (proves the Q/K row
  un-permutation on blocks and the fusion), logits close, an IQ2_XXS tensor fails naming itself;
  quantization none / int8 / int4 on it; CUDA dequantizes (when there is a GPU).
- Tiny safetensors checkpoints quantized at load (int8, int4).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.quant_helpers import (
    BF16_U,
    Q,
    one_thread,  # noqa: F401 - autouse: one intra-op thread in this module
    q4_k_blocks,
)
from worker.model.checkpoint import read_gguf_tensor_infos
from worker.model.loader import load_model
from worker.model.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
)

# --- a synthetic llama GGUF ----------------------------------------------------------------------

TINY = dict(vocab=96, hidden=256, ffn=256, layers=2, heads=4, kv_heads=2)
MIXED_TYPES = {  # every family the loader handles, and a q|k|v fused from three 4-bit types
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.attn_v.weight": "Q4_K",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "F16",
    "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q4_1",
    "blk.1.ffn_gate.weight": "Q4_K",
    "blk.1.ffn_up.weight": "Q4_0",
    "blk.1.ffn_down.weight": "F32",
    "token_embd.weight": "Q8_0",
}


def _raw_tensor(qtype: str, rows: int, cols: int, rng) -> tuple[np.ndarray, Q | None]:
    if qtype in ("F32", "F16"):
        dtype = np.float32 if qtype == "F32" else np.float16
        return (rng.standard_normal((rows, cols)) * 0.05).astype(dtype), None
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(w, Q[qtype]), Q[qtype]
    if qtype == "Q4_K":
        return q4_k_blocks(rows, cols, int(rng.integers(1 << 30))), Q.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]  # Q6_K, IQ2_XXS: random blocks
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == "Q6_K":  # int8 sub-scales in -8..8, d ~ 1e-3
        raw[..., 192:208] = rng.integers(-8, 9, (rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        d = (rng.random((rows, cols // block, 1)) * 1e-3 + 1e-4).astype(np.float16)
        raw[..., 208:210] = d.view(np.uint8)
    return raw.reshape(rows, -1), Q[qtype]


def write_tiny_gguf(path, types: dict[str, str], seed: int = 0):
    c = TINY
    head_dim = c["hidden"] // c["heads"]
    shapes = {"token_embd.weight": (c["vocab"], c["hidden"]), "output_norm.weight": (c["hidden"],)}
    for i in range(c["layers"]):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (c["hidden"],),
                f"blk.{i}.ffn_norm.weight": (c["hidden"],),
                f"blk.{i}.attn_q.weight": (c["hidden"], c["hidden"]),
                f"blk.{i}.attn_k.weight": (c["kv_heads"] * head_dim, c["hidden"]),
                f"blk.{i}.attn_v.weight": (c["kv_heads"] * head_dim, c["hidden"]),
                f"blk.{i}.attn_output.weight": (c["hidden"], c["hidden"]),
                f"blk.{i}.ffn_gate.weight": (c["ffn"], c["hidden"]),
                f"blk.{i}.ffn_up.weight": (c["ffn"], c["hidden"]),
                f"blk.{i}.ffn_down.weight": (c["hidden"], c["ffn"]),
            }
        )
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c["vocab"])
    w.add_eos_token_id(2)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data, raw_dtype = _raw_tensor(types.get(name, "Q4_1"), *shape, rng)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED_TYPES)


def test_header_walk_matches_gguf_reader(mixed_gguf):
    reader = gguf.GGUFReader(str(mixed_gguf))
    ours = {t.name: t for t in read_gguf_tensor_infos(mixed_gguf)}
    blob = mixed_gguf.read_bytes()
    assert set(ours) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        info = ours[t.name]
        assert info.type_name == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert blob[info.offset : info.offset + info.nbytes] == t.data.tobytes()


def _forward_logits(model, ids: list[int]) -> torch.Tensor:
    from benchmarks.quant_accuracy import Runner

    return Runner(model, len(ids), 1).score([ids[:1]], [ids[1:] + [0]])[0]


def test_mixed_gguf_quantized_modules_equal_the_float32_weights(mixed_gguf):
    ref = load_model(mixed_gguf, "float32", "cpu", quantization="auto").model  # float32: all dense
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in ref.modules())
    quant = load_model(mixed_gguf, "bfloat16", "cpu", quantization="auto").model
    l0, l1 = quant.layers[0], quant.layers[1]
    expect = {
        l0.self_attn.qkv_proj: Int4Linear,
        l0.self_attn.o_proj: Int4Linear,
        l0.mlp.gate_up_proj: nn.Linear,
        l0.mlp.down_proj: Int8Linear,
        l1.self_attn.qkv_proj: Int4Linear,
        l1.self_attn.o_proj: Int4Linear,
        l1.mlp.gate_up_proj: Int4Linear,
        l1.mlp.down_proj: nn.Linear,
        quant.embed_tokens: Int8Embedding,
    }
    for module, cls in expect.items():
        assert type(module) is cls
    assert l0.self_attn.o_proj.input_repeats == 2 and l1.self_attn.qkv_proj.input_repeats == 2  # Q8_0
    assert l0.mlp.gate_up_proj.weight.dtype == torch.bfloat16
    ref_mods = dict(ref.named_modules())
    for name, module in quant.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear, Int8Embedding)):
            w_ref = ref_mods[name].weight.detach()
            w = module.dequantize()
            if isinstance(module, Int4Linear):  # exact blocks: only the bf16 scale/zero rounding
                bound = 2 * BF16_U * w_ref.abs().amax(1, keepdim=True)  # measured 1.0x BF16_U
            else:  # int8 rows: half a step + bf16 scale rounding
                bound = (0.5 / 127 + BF16_U) * w_ref.abs().amax(1, keepdim=True)
            assert bool(((w - w_ref).abs() <= bound + 1e-6).all()), name
    ids = [1, 17, 42, 5, 77, 3, 9, 60, 31, 2, 88, 12]
    out, out_ref = _forward_logits(quant, ids), _forward_logits(ref, ids)
    rel = float((out - out_ref).abs().max() / out_ref.abs().max())
    assert rel <= 0.05, rel  # measured 0.016 (dense bfloat16 of the same file: 0.009)


def test_unsupported_tensor_type_fails_naming_the_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "iq.gguf", {**MIXED_TYPES, "blk.1.ffn_up.weight": "IQ2_XXS"})
    for dtype, quantization in [("bfloat16", "auto"), ("float32", "none")]:
        with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*IQ2_XXS"):
            load_model(path, dtype, "cpu", quantization=quantization)


def test_quantization_none_and_explicit_modes_on_gguf(mixed_gguf):
    dense = load_model(mixed_gguf, "bfloat16", "cpu", quantization="none").model
    assert all(type(m) is not Int4Linear for m in dense.modules())
    assert dense.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    int8 = load_model(mixed_gguf, "bfloat16", "cpu", quantization="int8").model
    assert type(int8.layers[0].self_attn.qkv_proj) is Int4Linear  # stored 4-bit stays 4-bit
    assert type(int8.layers[0].mlp.gate_up_proj) is Int8Linear  # F16 quantized
    assert type(int8.layers[1].self_attn.qkv_proj) is Int8Linear  # Q8_0 requantized per channel
    int4 = load_model(mixed_gguf, "bfloat16", "cpu", quantization="int4").model
    for layer in int4.layers:
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = layer.get_submodule(path)
            assert type(module) is Int4Linear and module.input_repeats == 1


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: checks that quantized GGUF tensors are dequantized there",
)
def test_cuda_dequantizes_quantized_tensors(mixed_gguf):
    cuda = load_model(mixed_gguf, "bfloat16", "cuda", quantization="auto").model
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in cuda.modules())
    assert cuda.layers[0].self_attn.qkv_proj.weight.device.type == "cuda"
    ref = load_model(mixed_gguf, "float32", "cpu", quantization="none").model
    torch.testing.assert_close(
        cuda.layers[1].mlp.down_proj.weight.float().cpu(),
        ref.layers[1].mlp.down_proj.weight.detach().to(torch.bfloat16).float(),
    )


# --- dense safetensors checkpoints quantized at load ---------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_safetensors_quantized_at_load(tmp_path, quantization):
    from tests.tiny_llama import save_tiny

    path, hf = save_tiny(tmp_path, "llama3")  # untied lm_head
    ref = load_model(path, "float32", "cpu").model
    auto = load_model(path, "bfloat16", "cpu", quantization="auto").model
    assert not any(isinstance(m, (Int4Linear, Int8Linear, Int8Embedding)) for m in auto.modules())
    quant = load_model(path, "bfloat16", "cpu", quantization=quantization).model
    cls = Int8Linear if quantization == "int8" else Int4Linear
    assert type(quant.layers[0].self_attn.qkv_proj) is cls and type(quant.layers[1].mlp.down_proj) is cls
    assert type(quant.embed_tokens) is Int8Embedding and type(quant.lm_head) is Int8Linear
    ref_mods = dict(ref.named_modules())
    for name, module in quant.named_modules():
        if isinstance(module, cls):
            w_ref = ref_mods[name].weight.detach()
            err = (module.dequantize() - w_ref).abs().max() / w_ref.abs().max()
            assert float(err) <= (0.005 if quantization == "int8" else 0.1), name  # measured 0.0039, 0.064
    ids = [5, 9, 17, 33, 2, 8, 100, 41, 7, 3]
    out, out_ref = _forward_logits(quant, ids), _forward_logits(ref, ids)
    rel = float((out - out_ref).abs().max() / out_ref.abs().max())
    # measured 0.015 (int8) and 0.13 (int4: a random tiny model has no slack; dense bfloat16: 0.006)
    assert rel <= (0.05 if quantization == "int8" else 0.25), rel
