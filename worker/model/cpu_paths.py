"""CPU execution paths for the quantized modules of worker/model/quant.py, picked per module at load.

Contract:
- `use_int8_activations(model) -> int`: int4 / int8 modules multiply int8 activations with
  AVX512-VNNI or AVX2 dot products (W4A8 / W8A8; `--no-cpu-int8-activations` keeps bfloat16
  activations).
- `use_dequant_gemm(model, int4_min_rows, int8_min_rows) -> int`: inputs of many rows run as
  bfloat16 GEMMs on weights dequantized per call (`--int4-dequant-min-rows`, default 32;
  `--int8-dequant-min-rows`, default 16); modules already on the VNNI ops keep them.
- `keep_dense_copies(model, min_rows) -> bytes`: the opt-in hybrid (`--dense-weights-min-rows`).
- `row_thresholds(model) -> set[int]`: the row counts where some module switches path.
- `apply_cpu_paths(model, config=None, log=None) -> dict`: all three in that order, from an
  EngineConfig's fields (default: EngineConfig(), what a worker serves), each logged with what it
  converted: what a CPU model runner does after loading. Returns
  {"int8_activation_modules", "dequant_gemm_modules", "dense_copy_bytes"}.
The kernels, their measured speeds and crossovers: worker/kernels/cpu_quant.py.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from worker.kernels import cpu_quant
from worker.model.quant import Int4Linear, Int8Embedding, Int8Linear, QuantLinearBase


def use_int8_activations(model: nn.Module) -> int:
    """Every int4 / int8 module of `model` whose shape the VNNI ops take multiplies int8-quantized
    activations (per row and group of 32, llama.cpp's Q8 scheme) with AVX512-VNNI (or AVX2) dot products
    (worker/kernels/cpu_quant.py: 2-3x the int4 kernel's speed, 2.7-5x the int8 kernel's); the
    weights are re-laid out in place, no copy kept. Returns the number of modules converted (0
    when the CPU or the build has neither)."""
    if not cpu_quant.vnni_available():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            count += module.to_w4a8()
        elif isinstance(module, (Int8Linear, Int8Embedding)):
            count += module.to_w8a8()
    return count


def use_dequant_gemm(
    model: nn.Module,
    int4_min_rows: int = cpu_quant.INT4_MIN_ROWS,
    int8_min_rows: int = cpu_quant.INT8_MIN_ROWS,
) -> int:
    """Inputs of many rows skip the weight-only kernels, which re-read the weight every 1 (int8)
    or 4 (int4) rows: every Int4Linear whose shape the op takes runs inputs of >= int4_min_rows
    rows as one dequantization of its weight to a temporary bfloat16 matrix plus one GEMM, and
    every Int8Linear / Int8Embedding lm_head runs inputs of >= int8_min_rows rows as bfloat16
    GEMMs over tiles of dequantized rows (worker/kernels/cpu_quant.py has the numbers; no resident
    copy). 0 turns a kind off. Returns the number of modules that take it (0 when the op is
    unavailable)."""
    if not (int4_min_rows or int8_min_rows) or not cpu_quant.available():
        return 0
    count = 0
    for module in model.modules():
        if getattr(module, "w4a8", False) or getattr(module, "w8a8", False):
            continue  # the VNNI ops take every row count
        if isinstance(module, Int4Linear) and int4_min_rows and cpu_quant.supports(module.out_features):
            module.dequant_min_rows = int(int4_min_rows)
        elif isinstance(module, (Int8Linear, Int8Embedding)) and int8_min_rows:
            module.dequant_min_rows = int(int8_min_rows)
        else:
            continue
        count += 1
    return count


def keep_dense_copies(model: nn.Module, min_rows: int = 16) -> int:
    """Opt-in hybrid: every Int4Linear/Int8Linear/Int8Embedding of `model` also keeps a bfloat16
    copy of its weight and runs inputs of >= min_rows rows (prefill chunks, large decode batches,
    the lm_head of many sequences) through F.linear on it, where the weight-only kernels (a GEMV
    per 4 rows) lose: on 2 threads, all SmolLM2 linears at 512 rows took 821 ms as int4 vs 78 ms
    as bfloat16 (Xeon with AMX), and the crossover is between 8 and 16 rows there and on this
    repo's EPYC (docs/quantization.md). Costs 2 bytes per weight on top of the quantized ones
    (+257 MiB for SmolLM2: ~3.9x the GGUF file in all). Returns the bytes added.
    Note: a torch.compile'd step that skips guard evaluation keeps whichever branch it traced."""
    added = 0
    for module in model.modules():
        if isinstance(module, (QuantLinearBase, Int8Embedding)):
            module.keep_dense_copy(min_rows)
            added += module.dense.numel() * module.dense.element_size()
    return added


def row_thresholds(model: nn.Module) -> set[int]:
    """The row counts at which some module of `model` switches path (dequantize-then-GEMM, dense
    copies): what a compiled step must warm up on both sides of. Empty when every quantized module
    takes one path at any row count (int8 activations)."""
    found = set()
    for module in model.modules():
        if getattr(module, "dequant_min_rows", 0):
            found.add(int(module.dequant_min_rows))
        if getattr(module, "dense", None) is not None and module.dense_min_rows:
            found.add(int(module.dense_min_rows))
    return found


def apply_cpu_paths(model: nn.Module, config=None, log: logging.Logger | None = None) -> dict[str, int]:
    """The CPU paths an EngineConfig asks for (cpu_int8_activations, int4_dequant_min_rows,
    int8_dequant_min_rows, dense_weights_min_rows), applied to a loaded model in place."""
    if config is None:
        from worker.config import EngineConfig

        config = EngineConfig()
    log = log or logging.getLogger(__name__)
    converted = added = 0
    if config.cpu_int8_activations:
        converted = use_int8_activations(model)
        isa = cpu_quant.int8_dots_isa() or "no int8 dot products"
        log.info("int8 activations (%s) in %d quantized modules", isa, converted)
    int4_rows, int8_rows = config.int4_dequant_min_rows, config.int8_dequant_min_rows
    layers = use_dequant_gemm(model, int4_rows, int8_rows)
    log.info(
        "quantized modules dequantized per call for inputs of >= %d (int4) / %d (int8) rows: %d",
        int4_rows,
        int8_rows,
        layers,
    )
    if config.dense_weights_min_rows:
        added = keep_dense_copies(model, config.dense_weights_min_rows)
        log.info(
            "dense bfloat16 weight copies for inputs of >= %d rows: +%.0f MiB",
            config.dense_weights_min_rows,
            added / 2**20,
        )
    if converted or added:
        from worker.model.loader import release_freed_memory  # (the loader imports gguf: only here)

        release_freed_memory()  # the re-layouts' freed copies and transients (~70 MiB of RSS on SmolLM2)
    return {"int8_activation_modules": converted, "dequant_gemm_modules": layers, "dense_copy_bytes": added}
