"""PEFT LoRA adapter directories read for the engine (worker/lora.py serves them).

Contract
- `parse_entry("NAME=PATH")` -> (name, path) of one --lora-modules entry.
- `load_adapter(name, path, model, dtype, device) -> Adapter`: adapter_config.json (peft_type
  LORA) and adapter_model.safetensors (or .bin) checked against `model` (a LlamaModel) and turned
  into per-module (A [R, in], scale x B^T [R, out]) pairs of our fused linears, with each fused
  linear's shards (q|k|v, gate|up: A stacked, B^T block-diagonal). Ranks come
  from the tensors (rank_pattern), alpha from lora_alpha or the first alpha_pattern entry matching
  PEFT's module key, the scale alpha / rank (alpha / sqrt(rank) with use_rslora).
- `runtime_adapter_path(config, loaded, name, path)`: where a run-time load reads from, inside
  --lora-dir, or AdapterError (kind "off", "invalid", "full"): `name` canonical
  (common/adapter_names.py: no empty, `.` or `..` segment, no trailing `/`, so `sql/` or
  `x/../sql` is never a second adapter of `sql`); `path` resolved with its symbolic links and `..`
  segments, and refused unless the directory and its adapter files lie inside --lora-dir (a link
  or `..` that leads out of it, an absolute path elsewhere). A symbolic link inside --lora-dir to
  another adapter's directory there is a second name the operator made. `load_adapter(..., max_rank)`
  refuses a higher rank before allocating. `bytes_at_rank(model, rank, dtype)`: one adapter's most
  bytes at that rank (the KV pool leaves room for the run-time slots: worker/model_runner.py).
- failure modes: ValueError naming the adapter and the problem (docs/lora.md lists what is
  refused: DoRA, biases, modules_to_save, trainable tokens, layer replication, embeddings or
  lm_head, base-changing initializations, shapes that do not fit, other peft types).
- proven by tests/test_lora.py (against PEFT's own model; the refusals), tests/test_adapter_names.py
  (names, paths out of --lora-dir).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from common.adapter_names import name_problem

# PEFT's module name -> (our module under a decoder layer, its shard of a fused linear or None)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}
# adapter_config.json settings that change what an adapter computes beyond y += s B A x: refused
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
}
_KEY = re.compile(r"((?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.[^.]+)?\.weight")


def parse_entry(entry: str) -> tuple[str, Path]:
    name, sep, path = entry.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules entry {entry!r}: expected NAME=PATH")
    return name.strip(), Path(path.strip()).expanduser()


def _read_config(name: str, path: Path) -> dict:
    file = path / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except OSError as exc:  # its message would name the path: only the reason
        raise ValueError(f"adapter {name!r}: cannot read adapter_config.json: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"adapter {name!r}: adapter_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA is served")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"adapter {name!r}: {what} is not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(
        ("pissa", "olora", "corda", "loftq", "eva", "lora_ga")
    ):
        raise ValueError(
            f"adapter {name!r}: init_lora_weights {init!r} trains against a changed base model; "
            "convert it to a plain LoRA first (PEFT's path_initial_model_for_weight_conversion)"
        )
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"adapter {name!r}: fan_in_fan_out (GPT-2 style Conv1D weights) is not supported")
    return config


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.exists():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt file: safetensors / pickle errors of many types
        raise ValueError(f"adapter {name!r}: cannot read its weights ({type(exc).__name__})") from None
    raise ValueError(f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin")


def _alpha(config: dict, module: str) -> float:
    """`module`'s alpha (PEFT's module key, "model.layers.3.self_attn.q_proj"): the first
    alpha_pattern entry matching its end, as PEFT matches them, else lora_alpha."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return _finite_alpha(alpha, module)
    return _finite_alpha(config.get("lora_alpha", 8), module)


def _finite_alpha(value, module: str) -> float:
    """A finite number (JSON parses a literal NaN, and a NaN alpha turned every output to token 0);
    TypeError otherwise, which `load_adapter` reports as the named adapter's malformed config."""
    try:
        alpha = float(value)
    except (TypeError, ValueError):
        alpha = math.nan
    if not math.isfinite(alpha):
        raise TypeError(f"lora_alpha of {module} must be a finite number, got {value!r}")
    return alpha


class AdapterError(ValueError):
    """A refused run-time load or unload; `kind` is one of "invalid", "exists", "off", "full",
    "missing", "busy" (worker/server.py maps them to gRPC codes)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def adapter_capacity(config) -> int:
    """Adapters a worker may hold: --max-lora-adapters, or its start-up adapters if they are more."""
    return max(config.max_lora_adapters, len(config.lora_modules))


def check_runtime_name(config, loaded: tuple[str, ...], name: str, room: bool = True) -> None:
    """AdapterError unless run-time loading is on, `name` is well formed and free, and (`room`)
    the worker has room (--max-lora-adapters, or its start-up adapters if they are more)."""
    if not config.lora_dir:
        raise AdapterError("off", "run-time LoRA loading is off on this worker (start it with --lora-dir)")
    if problem := name_problem(name):
        raise AdapterError("invalid", problem)
    if name in loaded:
        raise AdapterError("exists", f"adapter {name!r} is loaded already (unload it first)")
    if room and len(loaded) >= adapter_capacity(config):
        raise AdapterError("full", f"this worker holds {len(loaded)} adapters, its --max-lora-adapters")


def runtime_adapter_path(config, loaded: tuple[str, ...], name: str, path: str) -> Path:
    """The directory to load adapter `name` from at run time: `path` (absolute, or relative to
    config.lora_dir) resolved, symbolic links included, inside config.lora_dir, and so are the
    adapter's files. AdapterError as `check_runtime_name`, or naming `path` (never the directory
    it resolved to) when it is not such a directory."""
    check_runtime_name(config, loaded, name, room=False)
    shown = path if len(path) <= 256 else path[:256] + "..."
    outside = AdapterError("invalid", f"adapter {name!r}: {shown!r} is not a directory inside --lora-dir")
    try:
        root = Path(config.lora_dir).expanduser().resolve()
        where = (root / path).resolve()  # an absolute `path` replaces root
        if not path or not where.is_relative_to(root):
            raise outside
        if not (where / "adapter_config.json").is_file():
            raise AdapterError("invalid", f"adapter {name!r}: {shown!r} has no adapter_config.json")
        files = [where / f for f in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")]
        if any(f.exists() and not f.resolve().is_relative_to(root) for f in files):
            raise outside  # a file linked from elsewhere
    except (OSError, RuntimeError):  # a symlink loop, a name too long, no permission
        raise outside from None
    check_runtime_name(config, loaded, name)  # room: after the path, so a wrong one is named as such
    return where


@dataclass
class Adapter:
    name: str
    path: Path
    # our module ("layers.0.self_attn.qkv_proj") -> (A [R, in], B^T [R, out]) in the model's dtype,
    # the scale in B
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # our module -> int64 [Q, 4]: rank rows r0:r1 of its B^T write output columns n0:n1 (one row per
    # shard: a fused linear's B^T is zero elsewhere; the C++ op reads only these blocks)
    shards: dict[str, torch.Tensor]


def bytes_at_rank(model: nn.Module, rank: int, dtype: torch.dtype) -> int:
    """The bytes `load_adapter` allocates for an adapter of `rank` on all seven projections of every
    layer of `model` (A and the block-diagonal B^T of each fused linear): the most one adapter of at
    most that rank takes."""
    shards: dict[str, int] = {}
    for target, _ in TARGETS.values():
        shards[target] = shards.get(target, 0) + 1
    elements = 0
    for layer in range(model.config.num_layers):
        for target, count in shards.items():
            module = model.get_submodule(f"layers.{layer}.{target}")
            elements += count * rank * (in_features_of(module) + out_features_of(module))
    return elements * torch.empty((), dtype=dtype).element_size()


def load_adapter(
    name: str, path: Path, model: nn.Module, dtype: torch.dtype, device, max_rank: int | None = None
) -> Adapter:
    """One PEFT adapter as per-module (A, B) pairs for `model` (a LlamaModel): the contract's checks;
    a config of the wrong types (an alpha that is no number, a pattern that is no regex) too.
    `max_rank` (run-time loads, --max-lora-rank): a higher rank is refused (AdapterError "invalid")
    before anything reaches the device."""
    try:
        return _load(name, path, model, dtype, device, max_rank)
    except (TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, re.error) as exc:
        raise ValueError(f"adapter {name!r}: malformed config ({type(exc).__name__}: {exc})") from None


def _load(
    name: str, path: Path, model: nn.Module, dtype: torch.dtype, device, max_rank: int | None
) -> Adapter:
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    cfg = model.config
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[int, str], str] = {}  # PEFT's module key, for alpha_pattern
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(
                f"adapter {name!r}: weight {key!r} is not a LoRA A/B of one of {sorted(TARGETS)} "
                "(embeddings and lm_head are not supported)"
            )
        layer, proj, ab = int(m[2]), m[3], m[4]
        keys[(layer, proj)] = m[1].removeprefix("base_model.model.")
        if proj not in TARGETS:
            raise ValueError(f"adapter {name!r}: target {proj!r} is not one of {sorted(TARGETS)}")
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter {name!r}: {key!r} names layer {layer}; the model has {cfg.num_layers}")
        pairs.setdefault((layer, proj), {})[ab] = tensor
    if not pairs:
        raise ValueError(f"adapter {name!r}: no LoRA weights in its files")
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shards = {0: (0, q), 1: (q, kv), 2: (q + kv, kv)}  # qkv_proj's output rows per shard
    gate_up = {0: (0, inter), 1: (inter, inter)}
    parts: dict[str, list] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {proj} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        target, shard = TARGETS[proj]
        module = model.get_submodule(f"layers.{layer}.{target}")
        out_rows = out_features_of(module)
        offset, size = (0, out_rows) if shard is None else (shards if "qkv" in target else gate_up)[shard]
        rank = a.shape[0] if a.dim() == 2 else 0
        if rank < 1 or b.dim() != 2 or b.shape != (size, rank) or a.shape[1] != in_features_of(module):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {proj}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                f"fit the base model (expected A (r, {in_features_of(module)}) and B ({size}, r))"
            )
        alpha = _alpha(config, keys[(layer, proj)])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts.setdefault(f"layers.{layer}.{target}", []).append((a, b * scale, offset, out_rows))
    rank = max(a.shape[0] for items in parts.values() for a, _, _, _ in items)
    if max_rank is not None and rank > max_rank:
        raise AdapterError(
            "invalid", f"adapter {name!r} has rank {rank}; this worker's --max-lora-rank is {max_rank}"
        )
    weights, shards = {}, {}
    for module_name, items in parts.items():
        a_cat = torch.cat([a for a, _, _, _ in items])  # (R, in)
        b_full = torch.zeros(items[0][3], a_cat.shape[0])  # (out, R): each shard's B at its rows
        col, blocks = 0, []
        for a, b, offset, _ in items:
            b_full[offset : offset + b.shape[0], col : col + a.shape[0]] = b
            blocks.append((col, col + a.shape[0], offset, offset + b.shape[0]))
            col += a.shape[0]
        weights[module_name] = (
            a_cat.to(device, dtype).contiguous(),
            b_full.t().to(device, dtype).contiguous(),
        )
        shards[module_name] = torch.tensor(blocks, dtype=torch.int64)
    return Adapter(name, path, weights, shards)


def out_features_of(module: nn.Module) -> int:
    return int(getattr(module, "out_features"))


def in_features_of(module: nn.Module) -> int:
    return int(getattr(module, "in_features"))
