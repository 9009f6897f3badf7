"""Weight loaders: GGUF (dequantized) and Hugging Face safetensors directories.

Contract: `load_model(path | None, dtype, device) -> LoadedModel(model, config, eos_token_ids,
name)`. GGUF tensors are dequantized to float32 with `gguf.quants.dequantize` (already in torch's
(out, in) layout), renamed to Hugging Face names, and the Q/K rows are un-permuted (llama.cpp's
converter interleaves them for its RoPE layout; without the fix the model runs but says nonsense).
Fails how: unknown architecture, missing or mis-shaped tensors -> ValueError/KeyError naming them.
Proven by tests/test_engine_hf.py (logits equal transformers' on the same GGUF).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.model_files import default_model_path, read_gguf_metadata
from worker.config import ModelConfig, RopeScaling
from worker.model.llama import LlamaModel

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    name: str
    load_s: float


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (as transformers' reverse_permute_weights does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_model_config(meta: dict) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    num_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    scaling = None
    if g("rope.scaling.type") == "llama3" or g("rope.scaling.factor"):
        scaling = RopeScaling(factor=float(g("rope.scaling.factor", 1.0)),
                              original_max_position=int(g("rope.scaling.original_context_length", 8192)))
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=num_heads, num_kv_heads=int(g("attention.head_count_kv", num_heads)),
        head_dim=int(g("rope.dimension_count", hidden // num_heads)),
        max_position=int(g("context_length", 4096)), rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True, qkv_bias=arch == "qwen2", rope_scaling=scaling,
        name=str(meta.get("general.name", arch)))


def load_gguf_weights(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name == "token_embd.weight":
            name = "embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name.startswith("blk."):
            _, layer, kind, suffix = t.name.split(".", 3)
            if kind not in _GGUF_NAMES:
                continue
            name = f"layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
            if kind == "attn_q" and suffix == "weight":
                data = _unpermute(data, cfg.num_heads)
            elif kind == "attn_k" and suffix == "weight":
                data = _unpermute(data, cfg.num_kv_heads)
        else:
            continue
        # Writable: torch warns on read-only arrays (unquantized tensors are views of the mmap).
        weights[name] = torch.from_numpy(np.require(data, requirements=["C", "W"]))
    return weights


def hf_model_config(config: dict) -> ModelConfig:
    arch = config.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {SUPPORTED_ARCHS})")
    num_heads = config["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
    rs = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = rs.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = None
    if rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                              high_freq_factor=rs["high_freq_factor"],
                              original_max_position=rs["original_max_position_embeddings"])
    return ModelConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        max_position=config.get("max_position_embeddings", 4096),
        rope_theta=rope_theta, rms_eps=config.get("rms_norm_eps", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", False),
        qkv_bias=config.get("attention_bias", arch == "qwen2"), rope_scaling=scaling,
        name=config.get("_name_or_path") or arch)


def load_safetensors_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], tuple[int, ...]]:
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    cfg = hf_model_config(config)
    if cfg.name in (config.get("model_type"), "llama"):
        cfg = ModelConfig(**{**cfg.__dict__, "name": path.name})
    return cfg, weights, eos_ids


def load_model(path: str | Path | None, dtype: str = "float32",
               device: str | torch.device = "cpu", quantization: str = "none") -> LoadedModel:
    start = time.perf_counter()
    path = Path(path) if path else default_model_path()
    if path.is_dir():
        cfg, weights, eos_ids = load_safetensors_dir(path)
    elif path.suffix == ".gguf":
        meta = read_gguf_metadata(path)
        cfg = gguf_model_config(meta)
        weights = load_gguf_weights(path, cfg)
        eos_ids = tuple(i for i in (meta.get("tokenizer.ggml.eos_token_id"),) if i is not None)
        cfg = ModelConfig(**{**cfg.__dict__, "tie_embeddings": "lm_head.weight" not in weights})
    else:
        raise ValueError(f"model path {path} is neither a .gguf file nor a directory")
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device="cpu")     # no random init: every weight is loaded below
    model.load_hf_state_dict(weights)
    model = model.to(dtype=_DTYPES[dtype], device=device).eval()
    model.reset_rope()                        # float32 tables, whatever the weights' dtype
    return LoadedModel(model, cfg, eos_ids, cfg.name, time.perf_counter() - start)
