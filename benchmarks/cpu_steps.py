"""What each CPU speed-up step buys: engine decode step time with the steps switched on one by one.

Contract: `python -m benchmarks.cpu_steps [--threads N] [--batches 1,8,32] [--tokens 48]` builds one
LLMEngine per configuration on the embedded SmolLM2 GGUF, in this order (each adds one step to
the one before):
  0. before: float32 weights (dequantized GGUF), float32 KV, the per-sequence torch attention path,
     eager (what `make serve` ran before these steps);
  1. + the batched C++ paged-attention op ("cpu" backend);
  2. + bfloat16 activations and KV, GGUF Q4_1/Q8_0 weights kept quantized (torch's weight-only
     int4/int8 kernels at every row count), the norms, RoPE, KV store and SiLU as torch ops (the
     "cpu" backend's fused ops switched off);
  3. + the fused C++ small ops (worker/kernels/cpu_fused.py);
  4. + many-row inputs as bfloat16 GEMMs on weights dequantized per call (int4 from 32 rows,
     the int8 lm_head from 16: worker/kernels/cpu_quant.py);
  5. + int8 activations with AVX512-VNNI (W4A8 / W8A8 at every row count; where the CPU has no
     VNNI this row runs step 4 again);
  6. + the decoder layers of a step as one C++ op call (worker/kernels/cpu_layers.py): the default
     (without VNNI, step 4's linears with the op);
  7. + the compiled model step (--cpu-compile: inductor, opt-in; it replaces the fused ops and the
     layer op);
  8. + dense bfloat16 weight copies for inputs of >= 16 rows (--dense-weights-min-rows 16, opt-in,
     +257 MiB), compiled.
For each batch size B it adds B greedy requests of 200 prompt tokens and 48 output tokens
(ignore_eos) at once and reports the median wall time of the last 40 decode steps (ms) and
B / that time (decode tok/s), plus the prefill time of the B prompts. Prints one markdown table
and writes JSON to results/cpu_steps/<UTC time>.json. Timings are wall clock on a shared machine:
run it on a quiet one, and compare only within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from loadtest.environment import cpu_model

# Steps 0-4 switch off what later steps add (EngineConfig defaults turn everything on).
_NO_NEW_PATHS = dict(
    cpu_int8_activations=False, int4_dequant_min_rows=0, int8_dequant_min_rows=0, cpu_layer_op=False
)
STEPS = [
    (
        "0 before: float32, torch attention, eager",
        dict(
            dtype="float32",
            quantization="none",
            attention_backend="torch",
            enforce_eager=True,
            **_NO_NEW_PATHS,
        ),
    ),
    (
        "1 + cpu attention op",
        dict(
            dtype="float32", quantization="none", attention_backend="cpu", enforce_eager=True, **_NO_NEW_PATHS
        ),
    ),
    (
        "2 + bf16, int4/int8 weights, torch small ops",
        dict(
            dtype="bfloat16",
            quantization="auto",
            attention_backend="cpu",
            enforce_eager=True,
            fused_ops=False,
            **_NO_NEW_PATHS,
        ),
    ),
    (
        "3 + fused C++ small ops",
        dict(
            dtype="bfloat16",
            quantization="auto",
            attention_backend="cpu",
            enforce_eager=True,
            **_NO_NEW_PATHS,
        ),
    ),
    (
        "4 + dequantize-then-GEMM for many rows",
        dict(
            dtype="bfloat16",
            quantization="auto",
            enforce_eager=True,
            cpu_int8_activations=False,
            cpu_layer_op=False,
        ),
    ),
    (
        "5 + int8 activations, VNNI",
        dict(dtype="bfloat16", quantization="auto", enforce_eager=True, cpu_layer_op=False),
    ),
    (
        "6 + decoder layers as one C++ op (the default)",
        dict(dtype="bfloat16", quantization="auto", enforce_eager=True),
    ),
    ("7 + compiled step (--cpu-compile)", dict(cpu_compile=True)),
    ("8 + dense copies >= 16 rows (opt-in)", dict(cpu_compile=True, dense_weights_min_rows=16)),
]


def run_config(overrides: dict, batches: list[int], tokens: int, threads: int) -> dict:
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    overrides = dict(overrides)
    fused_ops = overrides.pop("fused_ops", True)  # not an EngineConfig field: the backend's
    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(kv_cache_bytes=512 * 2**20, max_num_seqs=64, num_threads=threads, **overrides)
    )
    if not fused_ops:
        engine.runner.backend.fused = engine.runner.backend.rope_store_kv = None
        engine.runner.cpu_layers = None
    result = {"startup_s": time.perf_counter() - start, "batches": {}}
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for b in batches:
        for i in range(b):
            engine.add_request(f"b{b}-{i}", [(100 + i + j) % 49000 for j in range(200)], sp)
        steps, prefill_s, t_first = [], 0.0, None
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if t_first is None:
                prefill_s += dt
                if outs and len([o for o in outs if o.new_token_ids]) == b:
                    t_first = dt
            else:
                steps.append(dt)
        step = statistics.median(steps[-40:])
        result["batches"][b] = {
            "decode_step_ms": step * 1e3,
            "decode_tok_s": b / step,
            "prefill_s": prefill_s,
        }
    del engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    from worker.host import default_num_threads

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_steps", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=default_num_threads())
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument(
        "--steps",
        default=",".join(str(i) for i in range(len(STEPS))),
        help="which configurations to run (indices)",
    )
    a = p.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    chosen = [STEPS[int(i)] for i in a.steps.split(",")]
    when = datetime.now(timezone.utc)
    print(
        f"cpu steps: {cpu_model()}, {a.threads} threads, batches {batches}, {a.tokens} output tokens",
        flush=True,
    )
    rows = []
    for name, overrides in chosen:
        r = run_config(overrides, batches, a.tokens, a.threads)
        rows.append({"step": name, **r})
        cells = ", ".join(
            f"B={b}: {v['decode_step_ms']:.1f} ms ({v['decode_tok_s']:.0f} tok/s)"
            for b, v in r["batches"].items()
        )
        print(f"  {name}: start-up {r['startup_s']:.1f} s; {cells}", flush=True)
    head = " | ".join(f"B={b} step ms | B={b} tok/s | B={b} prefill s" for b in batches)
    print(f"\n| step | start-up s | {head} |")
    print("|---|---:|" + "---:|" * (3 * len(batches)))
    for r in rows:
        cells = " | ".join(
            f"{v['decode_step_ms']:.1f} | {v['decode_tok_s']:.1f} | {v['prefill_s']:.2f}"
            for v in r["batches"].values()
        )
        print(f"| {r['step']} | {r['startup_s']:.1f} | {cells} |")
    out = Path("results/cpu_steps")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{when:%Y%m%d-%H%M%S}.json"
    path.write_text(
        json.dumps(
            {
                "when": when.isoformat(),
                "cpu": cpu_model(),
                "threads": a.threads,
                "tokens": a.tokens,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
