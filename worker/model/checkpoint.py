"""Checkpoint reading for the loader (worker/model/loader.py): model configs and lazy, Hugging
Face-named weight tensors from GGUF files and safetensors directories.

Contract
- `gguf_model_config(meta)` / `hf_model_config(config.json dict)` -> ModelConfig (llama, qwen2,
  mistral; llama3 RoPE scaling; Qwen2's q/k/v bias); another architecture -> ValueError.
- `gguf_tensors(path, cfg, arch)` -> {HF name: GGUFTensor}, all read through one read-only memory
  map of the file (blocks the model has no use for skipped); llama.cpp's Q/K row permutation
  (llama/mistral files only) is undone as a row index, on the raw block rows. A tensor type
  outside GGUF_SUPPORTED_TYPES -> ValueError naming tensor and type.
- `safetensors_tensors(dir)` -> (ModelConfig, {HF name: SafetensorsTensor}, eos ids from
  config.json and generation_config.json); no *.safetensors -> FileNotFoundError, a dtype outside
  DENSE_TYPES -> ValueError.
- `CheckpointTensor`: one weight in torch layout (`shape` (out, in) or (n,)), read when asked:
  `dense(start, stop)` -> float32 rows [stop - start, in] in memory of its own; `int4()` /
  `int4x2()` (GGUF 4-bit / Q8_0) -> (q, scale, zero) as worker/model/gguf_quant.py decodes them;
  `release()` drops the tensor's pages of the file from RSS (madvise DONTNEED; the page cache
  keeps them).
- `read_gguf_tensor_infos(path)` -> name, type, shape and absolute byte range of every tensor, from
  the header alone (~0.1 s); `load_gguf_weights(path, cfg)` -> every used tensor in float32 (the
  whole model: benchmarks and transformers comparisons only).
- State: none beyond the memory map / safetensors handles each tensor holds.
- Proven by tests/test_engine_hf.py (float32 logits equal transformers' on the same GGUF),
  tests/test_engine_tiny.py (safetensors, llama3 RoPE scaling, Qwen2 bias), tests/test_quant_gguf.py
  (GGUF types, byte ranges, 4-bit decoding) and tests/test_tp_model.py (sliced tensors).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.model_files import HeaderReader, read_gguf_metadata
from worker.config import ModelConfig, RopeScaling
from worker.model.gguf_quant import GGUF_INT4_TYPES

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
# llama.cpp's converter permutes the Q/K rows of these architectures only (as transformers assumes).
_PERMUTED_ARCHS = ("llama", "mistral")
_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
DENSE_TYPES = ("F32", "F16", "BF16")
# Dequantized by gguf.quants (and the 4-bit ones decoded exactly by worker/model/gguf_quant.py).
GGUF_SUPPORTED_TYPES = DENSE_TYPES + (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


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
        scaling = RopeScaling(
            factor=float(g("rope.scaling.factor", 1.0)),
            original_max_position=int(g("rope.scaling.original_context_length", 8192)),
        )
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv", num_heads)),
        head_dim=int(g("rope.dimension_count", hidden // num_heads)),
        max_position=int(g("context_length", 4096)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,
        qkv_bias=arch == "qwen2",
        rope_scaling=scaling,
        name=str(meta.get("general.name", arch)),
    )


class CheckpointTensor:
    """One weight in torch layout (`shape`: (out, in) or (n,)), read when asked: `dense(start,
    stop)` -> float32 rows; `int4()` -> (q, scale, zero) when `type_name` is a 4-bit GGUF type."""

    name: str
    type_name: str
    shape: tuple[int, ...]

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise NotImplementedError  # abstract: GGUFTensor and SafetensorsTensor read their own storage

    def int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise ValueError(f"{self.name}: {self.type_name} is not stored as 4-bit blocks")

    def release(self) -> None:
        """Done with this tensor: drop whatever of the file it kept resident."""


@dataclass
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: (rows, cols); GGUF lists ne0 (cols) first
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_gguf_tensor_infos(path: str | Path) -> list[GGUFTensorInfo]:
    """Name, type, shape and byte range of every tensor, from the header (gguf.GGUFReader builds a
    numpy view per metadata array element: ~5 s for SmolLM2's vocabulary; this walk: ~0.1 s)."""
    import gguf

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, num_tensors, num_fields = struct.unpack_from("<IQQ", blob, 4)
        reader = HeaderReader(blob, pos=24)
        alignment = 32
        for _ in range(num_fields):
            key = reader.string()
            value = reader.value(gguf.GGUFValueType(reader.scalar("<I")))
            if key == "general.alignment":
                alignment = int(value)
        raw = []
        for _ in range(num_tensors):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            type_id, offset = reader.scalar("<I"), reader.scalar("<Q")
            raw.append((name, dims, type_id, offset))
        data_start = -(-reader.pos // alignment) * alignment
    infos = []
    for name, dims, type_id, offset in raw:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown type id {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        numel = int(np.prod(dims)) if dims else 1
        infos.append(
            GGUFTensorInfo(
                name, qtype.name, tuple(reversed(dims)), data_start + offset, numel // block * type_size
            )
        )
    return infos


class GGUFTensor(CheckpointTensor):
    def __init__(self, name: str, info: GGUFTensorInfo, mapped: mmap.mmap, row_perm: np.ndarray | None):
        self.name, self.info, self.mapped, self.row_perm = name, info, mapped, row_perm
        self.data = np.frombuffer(mapped, dtype=np.uint8)
        self.type_name, self.shape = info.type_name, info.shape

    def release(self) -> None:
        """madvise(DONTNEED) over the tensor's pages: they leave this process's RSS (the page
        cache keeps them), so loading never holds the whole file resident on top of the model."""
        page = mmap.PAGESIZE
        start = self.info.offset // page * page
        end = min(-(-(self.info.offset + self.info.nbytes) // page) * page, len(self.mapped))
        if hasattr(self.mapped, "madvise") and end > start:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _raw(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The tensor's bytes as [rows, row_bytes] (1-D tensors: one row), rows start:stop."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        raw = self.data[self.info.offset : self.info.offset + self.info.nbytes].reshape(rows, -1)
        if self.row_perm is not None:
            return raw[self.row_perm][start:stop]
        return raw[start:stop]

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        import gguf

        raw = self._raw(start, stop)
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.type_name])
        out = np.array(out, dtype=np.float32, copy=True)  # own memory: never a view of the map
        return torch.from_numpy(out.reshape(-1) if len(self.shape) == 1 else out)

    def int4x2(self):
        """Q8_0 as two int4 halves (worker/model/gguf_quant.py: decode_gguf_q8_0_int4x2)."""
        from worker.model.gguf_quant import decode_gguf_q8_0_int4x2

        if self.type_name != "Q8_0":
            raise ValueError(f"{self.name}: {self.type_name} is not Q8_0")
        return decode_gguf_q8_0_int4x2(self._raw())

    def int4(self):
        if self.type_name not in GGUF_INT4_TYPES:
            return super().int4()
        from worker.model.gguf_quant import decode_gguf_int4

        return decode_gguf_int4(self._raw(), self.type_name)


class SafetensorsTensor(CheckpointTensor):
    def __init__(self, name: str, handle, key: str):
        self.name, self.handle, self.key = name, handle, key
        sl = handle.get_slice(key)
        self.shape = tuple(sl.get_shape())
        self.type_name = sl.get_dtype()
        if self.type_name not in DENSE_TYPES:
            raise ValueError(
                f"safetensors tensor {key!r} has dtype {self.type_name}; only "
                f"{', '.join(DENSE_TYPES)} checkpoints are supported"
            )

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if start == 0 and stop is None:
            return self.handle.get_tensor(self.key).float()
        return self.handle.get_slice(self.key)[start:stop].float()


def gguf_tensors(path: Path, cfg: ModelConfig, arch: str) -> dict[str, CheckpointTensor]:
    """Hugging Face-named lazy tensors of a GGUF file, read through one memory map of it (blocks
    the model does not use are skipped); the map closes when the last tensor is dropped."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors: dict[str, CheckpointTensor] = {}
    for info in read_gguf_tensor_infos(path):
        if info.name == "token_embd.weight":
            name = "embed_tokens.weight"
        elif info.name == "output_norm.weight":
            name = "norm.weight"
        elif info.name == "output.weight":
            name = "lm_head.weight"
        elif info.name.startswith("blk."):
            _, layer, kind, suffix = info.name.split(".", 3)
            if kind not in _GGUF_NAMES:
                continue
            name = f"layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
        else:
            continue
        if info.type_name not in GGUF_SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {info.name!r} has type {info.type_name}, which this loader "
                f"does not support (supported: {', '.join(GGUF_SUPPORTED_TYPES)})"
            )
        perm = None
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            perm = _unpermute(np.arange(info.shape[0]), heads)
        tensors[name] = GGUFTensor(info.name, info, data, perm)
    return tensors


def load_gguf_weights(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every used GGUF tensor dequantized to float32, Hugging Face-named (benchmarks, transformers
    comparisons). The whole model in float32: load_model never calls this."""
    arch = read_gguf_metadata(path)["general.architecture"]
    return {name: t.dense() for name, t in gguf_tensors(Path(path), cfg, arch).items()}


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
        scaling = RopeScaling(
            factor=rs["factor"],
            low_freq_factor=rs["low_freq_factor"],
            high_freq_factor=rs["high_freq_factor"],
            original_max_position=rs["original_max_position_embeddings"],
        )
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        max_position=config.get("max_position_embeddings", 4096),
        rope_theta=rope_theta,
        rms_eps=config.get("rms_norm_eps", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias")),  # Qwen2 writes null
        rope_scaling=scaling,
        name=config.get("_name_or_path") or arch,
    )


def safetensors_tensors(path: Path) -> tuple[ModelConfig, dict[str, CheckpointTensor], tuple[int, ...]]:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, CheckpointTensor] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for key in handle.keys():
            name = key.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            tensors[name] = SafetensorsTensor(key, handle, key)
    generation_file = path / "generation_config.json"  # Llama-3-Instruct lists <|eot_id|> only here
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos_ids: tuple[int, ...] = ()
    for eos in (config.get("eos_token_id"), generation.get("eos_token_id")):
        for i in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
            eos_ids += (i,) if i not in eos_ids else ()
    cfg = hf_model_config(config)
    if cfg.name in (config.get("model_type"), "llama"):
        cfg = ModelConfig(**{**cfg.__dict__, "name": path.name})
    return cfg, tensors, eos_ids
