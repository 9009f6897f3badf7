"""LoRA adapters served beside the base model: several per worker, chosen per request.

Contract
- input: `--lora-modules NAME=PATH,...` (EngineConfig.lora_modules) read by worker/lora_files.py
  (PEFT directories -> per-module A, scaled B^T and shards), and with `--lora-dir` adapters loaded
  and unloaded between steps (`Adapters.load` / `unload`, from worker/engine.py). A request names
  one by `SamplingParams.adapter` ("" = the base model).
- `Adapters` wraps each targeted linear in a `LoraLinear` (its own module kept as `.base`):
  `y = base(x) + (x @ A^T) @ (scale B)^T` for the rows of the adapters that target it, nothing
  for the others; the delta in float32, added to the output widened to float32 and rounded once.
  q|k|v and gate|up are fused linears here (worker/model/llama.py): an adapter's A matrices of one
  fused linear are stacked and its B matrices placed block-diagonally at their shard's output
  rows. A and B are kept in the model's activation dtype (bfloat16 beside int4 / int8 weights: the
  adapter is not quantized; float32 would double the bytes read every step). Each load gets a
  new slot (1, 2, ...; never reused); with `--lora-dir` every linear is wrapped at start-up.
- per step: `slots(plan)` -> each scheduled sequence's adapter slot, or None when no sequence of
  the step has one; `active(slots, query_start_loc)` is the context inside which the model's
  forward adds the deltas (the rows of each adapter as one slice or one index tensor, shared by
  every wrapped linear of the step). Outside it the wrappers add nothing, so CUDA graphs and the
  compiled CPU step keep serving the steps without an adapter row; in a step with one, the adapter
  rows run in an eager launch (on CUDA the base model's decode rows of the same step still replay
  their graph: worker/model_runner.py `_forward`), or on CPU the C++ layer op with the adapters'
  deltas added in C++ (`op_inputs`; worker/kernels/cpu_layers.cpp `lora_add`, tested against the
  wrappers).
- prefix cache: an adapter's KV differs from the base model's for the same tokens, and from an
  earlier load's of the same name, so its sequences hash their blocks under a salt of its name and
  slot (worker/engine.py `add_request`).
- failure modes: worker/lora_files.py's refusals (ValueError naming the adapter). Tensor
  parallelism and adapters together are refused by EngineConfig.
- proven by tests/test_lora.py: logits equal PEFT's own model over transformers on the same
  adapter, several adapters and the base model in one batch equal their runs alone, prefix-cache
  hits never cross adapters or loads, run-time loads equal start-up ones, the refusals; end to
  end through a router: tests/test_lora_e2e.py, tests/test_lora_runtime_e2e.py; base rows on CUDA
  graphs beside adapter rows: tests/test_lora_graphs.py; the memory reserve:
  tests/test_lora_memory.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from worker.lora_files import (
    Adapter,
    AdapterError,
    adapter_capacity,
    bytes_at_rank,
    check_runtime_name,
    in_features_of,
    load_adapter,
    out_features_of,
    parse_entry,
    runtime_adapter_path,
)


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
        self.in_features, self.out_features = in_features_of(base), out_features_of(base)
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

    def read(self, name: str, path: Path, max_rank: int | None = None) -> Adapter:
        """Adapter `name` read from `path` and checked against the model (ValueError): reads only
        the model's shapes, so it may run beside steps, off the engine thread."""
        return load_adapter(name, path, self._model, self._dtype, self._device, max_rank)

    def load(self, name: str, path: Path) -> int:
        """Loads adapter `name` from `path` into a new slot (`read`, then `install`)."""
        return self.install(name, self.read(name, path))

    def install(self, name: str, adapter: Adapter) -> int:
        """A read adapter into a new slot: dict entries only (between steps, on the engine thread)."""
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

    def bytes(self, adapter: Adapter | None = None) -> int:
        """The weights' bytes of `adapter`, or of every served adapter."""
        pairs = [p for a in ([adapter] if adapter else self.by_name.values()) for p in a.weights.values()]
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)

    def reserve_bytes(self, config) -> int:
        """Memory the KV pool leaves for run-time loads (with --lora-dir; before any): each free slot
        of --max-lora-adapters holds an adapter of --max-lora-rank on every projection at most, and
        each start-up adapter's slot what such an adapter needs beyond it (it may be unloaded and
        its slot filled at run time)."""
        if not config.lora_dir:
            return 0
        slot = bytes_at_rank(self._model, config.max_lora_rank, self._dtype)
        free = adapter_capacity(config) - len(self.by_name)
        return max(free, 0) * slot + sum(max(0, slot - self.bytes(a)) for a in self.by_name.values())

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


@dataclasses.dataclass(frozen=True)
class LoraFigures:
    adapters: int  # served now
    max_adapters: int  # --max-lora-adapters (or the start-up adapters, if more); without --lora-dir: those
    memory_bytes: int  # the served adapters' weights
    reserved_bytes: int  # what the KV pool left for run-time adapters when it was sized


class EngineAdapters:
    """LLMEngine's run-time LoRA loads and unloads (docs/lora.md, "Loading at run time"); uses its
    config, info, runner and scheduler."""

    def read_adapter(self, name: str, path: str):
        """A LoRA adapter read for `install_adapter`: any thread (docs/lora.md, "Loading at run
        time"). AdapterError: loading is off, `path` is not inside --lora-dir, the name is taken, the
        worker is full, the rank is above --max-lora-rank; ValueError: the adapter fails the
        loader's checks."""
        where = runtime_adapter_path(self.config, self.info.adapters, name, path)  # lora_dir is set
        return self.runner.adapters.read(name, where, self.config.max_lora_rank)

    def install_adapter(self, name: str, adapter) -> None:
        """Between steps: serves a read adapter (the name and room checked again)."""
        check_runtime_name(self.config, self.info.adapters, name)
        self.runner.adapters.install(name, adapter)
        self._adapters_changed()

    def load_adapter(self, name: str, path: str) -> None:
        self.install_adapter(name, self.read_adapter(name, path))

    def unload_adapter(self, name: str) -> None:
        """Drops a LoRA adapter; AdapterError when it is not loaded or requests still use it."""
        adapters = getattr(self.runner, "adapters", None)
        if adapters is None or name not in adapters.slot:
            raise AdapterError("missing", f"adapter {name!r} is not loaded here")
        users = sum(1 for seq in self.scheduler.requests.values() if seq.sampling.adapter == name)
        if users:
            raise AdapterError("busy", f"adapter {name!r} has {users} request(s) in flight; unload it after")
        adapters.unload(name)
        self._adapters_changed()

    def lora_figures(self) -> LoraFigures | None:
        """The LoRA gauges' figures, None without LoRA; computed on the engine thread, read by
        scrapes as one object (worker/metrics.py)."""
        adapters = getattr(self.runner, "adapters", None)
        if adapters is None:
            return None
        held = len(adapters.by_name)
        cap = adapter_capacity(self.config) if self.config.lora_dir else held  # no run-time loads
        reserved = getattr(self.runner, "lora_reserve", 0)
        return LoraFigures(held, cap, adapters.bytes(), reserved)

    def _adapters_changed(self) -> None:
        names, version = self.runner.adapters.names, self.info.info_version + 1
        self.info = dataclasses.replace(self.info, adapters=names, info_version=version)
        self.lora = self.lora_figures()
