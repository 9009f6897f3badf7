"""LoRA adapters served beside the base model: several per worker, chosen per request.

Contract
- input: `--lora-modules NAME=PATH,...` (EngineConfig.lora_modules); PATH is a PEFT adapter
  directory (adapter_config.json with peft_type LORA, and adapter_model.safetensors or .bin)
  trained on this worker's base model. The targets may be any of q/k/v/o_proj and
  gate/up/down_proj of any layers; each module's rank is its tensors' (rank_pattern), its alpha
  `lora_alpha` or the alpha_pattern entry matching it; the scale is alpha / rank (alpha / sqrt(rank)
  with use_rslora). A request names one by `SamplingParams.adapter` ("" = the base model).
- `Adapters(model, entries)` loads every adapter and wraps each targeted linear in a `LoraLinear`
  (its own module kept as `.base`): `y = base(x) + (x @ A^T) @ (scale B)^T` for the rows of the
  adapters that target it, nothing for the others; the delta in float32, added to the output
  widened to float32 and rounded once. q|k|v and gate|up are fused linears here
  (worker/model/llama.py): an adapter's A matrices of one fused linear are stacked and its B
  matrices placed block-diagonally at their shard's output rows. A and B are kept in the model's
  activation dtype (bfloat16 beside int4 / int8 weights: the adapter is not quantized; rank x (in +
  out) per linear, read every step with its rows: float32 would double those bytes).
- per step: `slots(plan)` -> each scheduled sequence's adapter slot (1..N), or None when no
  sequence of the step has one; `active(slots, query_start_loc)` is the context inside which the
  model's forward adds the deltas (the rows of each adapter as one slice or one index tensor,
  shared by every wrapped linear of the step). Outside it the wrappers add nothing, so CUDA
  graphs and the compiled CPU step keep serving the steps without an adapter row; a step with one
  runs the eager model (worker/model_runner.py), or on CPU the C++ layer op with the adapters'
  deltas added in C++ (`op_inputs`; worker/kernels/cpu_layers.cpp `lora_add`, tested against
  the wrappers).
- prefix cache: an adapter's KV differs from the base model's for the same tokens, so its
  sequences hash their blocks under their own salt (worker/engine.py `add_request`).
- failure modes (at start-up, ValueError naming the adapter and what is wrong): a missing or
  unreadable directory, another peft_type, DoRA, LoRA biases, modules_to_save, trainable tokens,
  layer replication, a target that is not one of those seven linears (embeddings, lm_head), a
  layer the model lacks, shapes that do not match the base model. Tensor parallelism and adapters
  together are refused by EngineConfig.
- proven by tests/test_lora.py: logits equal PEFT's own model over transformers on the same
  adapter, several adapters and the base model in one batch equal their runs alone, prefix-cache
  hits never cross adapters, the refusals; end to end through a router: tests/test_lora_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

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
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {name!r}: cannot read {file}: {exc}") from None
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
        raise ValueError(f"adapter {name!r}: cannot read its weights: {exc}") from None
    raise ValueError(f"adapter {name!r}: {path} has no adapter_model.safetensors or adapter_model.bin")


def _alpha(config: dict, module: str) -> float:
    """`module`'s alpha (PEFT's module key, "model.layers.3.self_attn.q_proj"): the first
    alpha_pattern entry matching its end, as PEFT matches them, else lora_alpha."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


class AdapterError(ValueError):
    """A refused run-time load or unload; `kind` is one of "invalid", "off", "full", "missing",
    "busy" (worker/server.py maps them to gRPC codes)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")


def runtime_adapter_path(config, loaded: tuple[str, ...], name: str, path: str) -> Path:
    """The directory to load adapter `name` from at run time: `path` (absolute, or relative to
    config.lora_dir) resolved, symbolic links included, and inside config.lora_dir. AdapterError
    when run-time loading is off, the name is malformed or taken, or the worker is full."""
    if not config.lora_dir:
        raise AdapterError("off", "run-time LoRA loading is off on this worker (start it with --lora-dir)")
    if not NAME.fullmatch(name):
        raise AdapterError("invalid", f"adapter name {name!r}: 1-128 of A-Z a-z 0-9 . _ : @ + / -")
    if name in loaded:
        raise AdapterError("invalid", f"adapter {name!r} is loaded already (unload it first)")
    if len(loaded) >= config.max_lora_adapters:
        raise AdapterError("full", f"this worker holds {len(loaded)} adapters, its --max-lora-adapters")
    root = Path(config.lora_dir).expanduser().resolve()
    where = (root / path).resolve()  # an absolute `path` replaces root
    if not path or not where.is_relative_to(root):
        raise AdapterError("invalid", f"adapter {name!r}: {path!r} is not a directory inside --lora-dir")
    if not (where / "adapter_config.json").is_file():
        raise AdapterError("invalid", f"adapter {name!r}: {path!r} has no adapter_config.json")
    return where


@dataclass
class Adapter:
    name: str
    path: Path
    # our module ("layers.0.self_attn.qkv_proj") -> (A [R, in], B^T [R, out]) in the model's dtype,
    # the scale in B
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    max_rank: int
    # our module -> int64 [Q, 4]: rank rows r0:r1 of its B^T write output columns n0:n1 (one row per
    # shard: a fused linear's B^T is zero elsewhere; the C++ op reads only these blocks)
    shards: dict[str, torch.Tensor]


def load_adapter(name: str, path: Path, model: nn.Module, dtype: torch.dtype, device) -> Adapter:
    """One PEFT adapter as per-module (A, B) pairs for `model` (a LlamaModel): the contract's checks."""
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
        raise ValueError(f"adapter {name!r}: no LoRA weights in {path}")
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shards = {0: (0, q), 1: (q, kv), 2: (q + kv, kv)}  # qkv_proj's output rows per shard
    gate_up = {0: (0, inter), 1: (inter, inter)}
    parts: dict[str, list] = {}
    max_rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {proj} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        target, shard = TARGETS[proj]
        module = model.get_submodule(f"layers.{layer}.{target}")
        out_rows = _out_features(module)
        offset, size = (0, out_rows) if shard is None else (shards if "qkv" in target else gate_up)[shard]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape != (size, rank) or a.shape[1] != _in_features(module):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {proj}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                f"fit the base model (expected A (r, {_in_features(module)}) and B ({size}, r))"
            )
        alpha = _alpha(config, keys[(layer, proj)])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts.setdefault(f"layers.{layer}.{target}", []).append((a, b * scale, offset, out_rows))
        max_rank = max(max_rank, rank)
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
    return Adapter(name, path, weights, max_rank, shards)


def _out_features(module: nn.Module) -> int:
    return int(getattr(module, "out_features"))


def _in_features(module: nn.Module) -> int:
    return int(getattr(module, "in_features"))


class _StepRows:
    """The rows of each adapter in the running step: [(slot, slice | index tensor)]; empty outside
    `Adapters.active`."""

    def __init__(self):
        self.rows: list[tuple[int, slice | torch.Tensor]] = []


class LoraLinear(nn.Module):
    """A base linear plus the deltas of the adapters that target it, for their rows of the step."""

    def __init__(self, base: nn.Module, step: _StepRows):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = _in_features(base), _out_features(base)
        self._step = step
        self.deltas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (A, B^T), scale in B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self._step.rows:
            ab = self.deltas.get(slot)
            if ab is None:
                continue
            a, bt = (t.float() for t in ab)  # the delta summed in float32, added, rounded once
            if isinstance(rows, slice):
                out[rows] = (out[rows].float() + (x[rows].float() @ a.t()) @ bt).to(out.dtype)
            else:
                mine = out.index_select(0, rows).float() + (x.index_select(0, rows).float() @ a.t()) @ bt
                out.index_copy_(0, rows, mine.to(out.dtype))
        return out


FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # the op's order


class Adapters:
    """The adapters of a worker by name and slot (1, 2, ...: never reused, so a slot names one load
    of one adapter). `runtime`: every linear of `FUSED` is wrapped up front, so that `load` and
    `unload` between steps only add or drop dict entries (no module changes under a compiled or
    captured model, nor under a step in flight)."""

    def __init__(self, model: nn.Module, entries: tuple[str, ...], dtype, device, runtime: bool = False):
        self.by_name: dict[str, Adapter] = {}
        self.slot: dict[str, int] = {}
        self._step = _StepRows()
        self._model, self._dtype, self._device = model, dtype, device
        self._wrapped: dict[str, LoraLinear] = {}
        self._op_weights: dict[int, list[torch.Tensor]] = {}
        self._op_rows: list[torch.Tensor] = []
        self._next_slot = 1
        if runtime:
            for layer in range(len(model.layers)):
                for target in FUSED:
                    self._wrap(f"layers.{layer}.{target}")
        for entry in entries:
            name, path = parse_entry(entry)
            if name in self.by_name:
                raise ValueError(f"--lora-modules: two adapters named {name!r}")
            self.load(name, path)

    def _wrap(self, module_name: str) -> LoraLinear:
        if module_name not in self._wrapped:
            parent_name, _, child = module_name.rpartition(".")
            parent = self._model.get_submodule(parent_name)
            self._wrapped[module_name] = LoraLinear(getattr(parent, child), self._step)
            setattr(parent, child, self._wrapped[module_name])
        return self._wrapped[module_name]

    @property
    def num_wrapped(self) -> int:
        return len(self._wrapped)

    def load(self, name: str, path: Path) -> int:
        """Loads adapter `name` from `path` (the contract's checks, ValueError) into a new slot."""
        adapter = load_adapter(name, path, self._model, self._dtype, self._device)
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        for module_name, ab in adapter.weights.items():
            self._wrap(module_name).deltas[slot] = ab
        # The C++ layer op's inputs (worker/kernels/cpu_layers.cpp): (A, B^T, shards) of each
        # layer's q|k|v, o, gate|up and down, three empty tensors where the adapter has none.
        empty, tensors = torch.empty(0), []
        for layer in range(len(self._model.layers)):
            for target in FUSED:
                key = f"layers.{layer}.{target}"
                found = key in adapter.weights
                tensors += [*adapter.weights[key], adapter.shards[key]] if found else [empty] * 3
        self._op_weights[slot] = tensors
        self.by_name[name], self.slot[name] = adapter, slot
        return slot

    def unload(self, name: str) -> None:
        """Drops adapter `name`; the caller has checked that no unfinished sequence uses it. A step
        already in flight may still hold rows of its finished sequences: they get no delta (their
        tokens are discarded)."""
        slot = self.slot.pop(name)
        del self.by_name[name]
        self._op_weights.pop(slot, None)
        for wrapper in self._wrapped.values():
            wrapper.deltas.pop(slot, None)

    @classmethod
    def attach(cls, model: nn.Module, config, device, log) -> Adapters | None:
        """`config`'s adapters (EngineConfig: lora_modules, lora_dir) wrapped into `model`; None when
        it has none and no run-time loading. Logged."""
        if not config.lora_modules and not config.lora_dir:
            return None
        adapters = cls(model, config.lora_modules, model.dtype, device, runtime=bool(config.lora_dir))
        log.info(
            "LoRA adapters %s: %d linears wrapped, %.1f MiB%s",
            ", ".join(adapters.names) or "(none yet)",
            adapters.num_wrapped,
            adapters.bytes() / 2**20,
            f"; run-time loading from {config.lora_dir}" if config.lora_dir else "",
        )
        return adapters

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def bytes(self) -> int:
        pairs = [p for a in self.by_name.values() for p in a.weights.values()]
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)

    def slots(self, plan) -> list[int] | None:
        """Each scheduled sequence's adapter slot (0 = base), or None when the step has no adapter row."""
        slots = [self.slot.get(s.seq.sampling.adapter, 0) for s in plan.scheduled]
        return slots if any(slots) else None

    @contextlib.contextmanager
    def active(self, slots: list[int], query_start_loc: np.ndarray):
        """The wrapped linears add each adapter's delta to its sequences' rows inside this context."""
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for i, slot in enumerate(slots):
            if slot and query_start_loc[i + 1] > query_start_loc[i]:
                by_slot.setdefault(slot, []).append((int(query_start_loc[i]), int(query_start_loc[i + 1])))
        rows: list[tuple[int, slice | torch.Tensor]] = []
        self._op_rows = []
        for slot, ranges in by_slot.items():
            index = torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in ranges]))
            if index.device != torch.device(self._device):  # CUDA: no sync with the step in flight
                index = index.pin_memory().to(self._device, non_blocking=True)
            self._op_rows.append(index)
            if all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1)):
                rows.append((slot, slice(ranges[0][0], ranges[-1][1])))  # one contiguous run
            else:
                rows.append((slot, index))
        self._step.rows = rows
        try:
            yield
        finally:
            self._step.rows, self._op_rows = [], []

    def op_inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Inside `active`: the C++ layer op's (lora, lora_rows) for the step's adapters (an adapter
        unloaded since the step was planned is left out, as the wrappers leave it out)."""
        weights, rows = [], []
        for (slot, _), index in zip(self._step.rows, self._op_rows):
            if (tensors := self._op_weights.get(slot)) is not None:
                weights += tensors
                rows.append(index)
        return weights, rows
