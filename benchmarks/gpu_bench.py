"""`make bench-gpu`: paged decode attention vs memory bandwidth, engine decode vs transformers.

Protocol (one GPU, no download: a randomly initialised Llama-3.2-1B-shaped model in bf16, LLAMA_1B
below). This module is the driver (sizes, the markdown, main()); every section is a module
stating its protocol, `<name>_section(res, sizes, device, deadline, save)` filling `res[...]` and
(except the bandwidth's, which the other tables use) `<name>_markdown(res)`:
1. Bandwidth: read-only and device-to-device copy bandwidth, benchmarks/gpu_bandwidth.py. Timing
   helpers (`time_ms`: CUDA-graph replay, median; `fmt`): benchmarks/gpu_common.py.
2. Decode attention at batch sizes 1-256 and contexts 512-32k, our Triton paged kernel vs SDPA, as
   a share of the measured read bandwidth: benchmarks/gpu_attention.py.
2b. Fused RMSNorm and RoPE kernels vs the model's torch code (benchmarks/gpu_fused.py), at 1 to
   4,096 tokens: whether they pay off, as the issue asks.
2c. Real checkpoint (SmolLM2-135M GGUF), engine with CUDA graphs vs `enforce_eager`, greedy:
   benchmarks/gpu_checkpoint.py; with staggered arrivals (mixed steps): benchmarks/gpu_mixed.py.
3. Engine vs transformers (eager, and static cache + `torch.compile`), decode and end-to-end tok/s:
   benchmarks/gpu_engine.py, which also holds
4. the HBM roofline of engine decode (bytes a decode step must read / step time, as a share of the
   measured read bandwidth, per batch size).
5. Steady serving (Poisson arrivals): benchmarks/gpu_steady.py; FP8 speed and accuracy:
   benchmarks/gpu_fp8.py; the decode step's Triton GEMV and fused sampling, alone and in the
   engine (right after the bandwidth): benchmarks/gpu_decode.py; LoRA adapter rows against base
   rows (after FP8): benchmarks/gpu_lora.py.
Results go to `$OUT` (else results/) as gpu_bench.json and gpu_bench.md, rewritten after every
case so a run cut short keeps what it measured; a case or section that fails is recorded (and
printed) and the rest still runs. `--smoke` runs tiny sizes (on CPU with Triton interpreted) so CI
exercises this script; there transformers' compile uses the "eager" dynamo backend (inductor on
CPU would take minutes) and the checkpoint check runs both engines eagerly (no CUDA graphs on CPU).
`--time-budget-s` skips whatever would start too late.
Imports only torch, triton, transformers and worker modules that need nothing else (the checkpoint
check also needs `gguf`, and `tokenizers` for text prompts, falling back to fixed token ids).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu_attention import attention_markdown, attention_section
from benchmarks.gpu_bandwidth import bandwidth_section
from benchmarks.gpu_checkpoint import checkpoint_markdown, checkpoint_section
from benchmarks.gpu_common import time_ms
from benchmarks.gpu_decode import decode_markdown, decode_section
from benchmarks.gpu_engine import engine_markdown, engine_section, roofline_section
from benchmarks.gpu_fp8 import fp8_markdown, fp8_section
from benchmarks.gpu_fused import fused_markdown, fused_section
from benchmarks.gpu_lora import lora_markdown, lora_section
from benchmarks.gpu_mixed import mixed_checkpoint_markdown, mixed_checkpoint_section
from benchmarks.gpu_steady import steady_markdown, steady_section
from benchmarks.report import git_short
from worker.config import ModelConfig

LLAMA_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    max_position=131072,
    rope_theta=500000.0,
    name="random-llama-3.2-1b-shape",
)
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,  # one layer: every interpreted kernel launch costs; the smoke proves only that it runs
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=512,
    name="random-tiny",
)
FULL = dict(
    model=LLAMA_1B,
    dtype=torch.bfloat16,
    copy_bytes=2**32,
    attn_batch_sizes=[1, 4, 16, 64, 256],
    contexts=[512, 2048, 8192, 32768],
    engine_batch_sizes=[1, 16, 64, 256],
    prompt_len=128,
    fused_tokens=[1, 16, 64, 256, 4096],
    output_len=128,
    max_num_batched_tokens=8192,
    max_model_len=2048,
    read_bytes=2**32,
    ckpt_dtype="bfloat16",
    ckpt_requests=16,
    ckpt_max_tokens=(24, 96),
    hf_compile=dict(mode="reduce-overhead"),
    hf_compile_min_s=150.0,
    ckpt_min_s=45.0,
    warm_up=True,
)
SMOKE = dict(
    model=TINY,
    dtype=torch.float32,
    copy_bytes=2**23,
    attn_batch_sizes=[1, 2],
    contexts=[32, 80],
    engine_batch_sizes=[1, 2],
    prompt_len=8,
    output_len=3,  # two decode steps after the first token: the fewest that time decode
    fused_tokens=[1, 8],
    max_num_batched_tokens=64,
    max_model_len=64,
    read_bytes=2**23,
    ckpt_dtype="float32",
    ckpt_requests=2,
    ckpt_max_tokens=(2, 3),
    # inductor on CPU takes minutes: the smoke run traces with dynamo and runs eagerly
    hf_compile=dict(backend="eager", mode=None),
    hf_compile_min_s=0.0,
    ckpt_min_s=0.0,
    # no untimed warm-up runs of our engine: on CPU, Triton interprets (nothing compiles, no graphs
    # to record), and each interpreted step costs a tenth of a second
    warm_up=False,
)


def markdown(res: dict) -> str:
    lines = [f"# GPU bench: {res['device']}, {res['model']['name']}, {res['dtype']}", ""]
    if res.get("section_errors"):
        lines += [
            "Sections that failed: " + "; ".join(f"{k}: {v}" for k, v in res["section_errors"].items()),
            "",
        ]
    lines += attention_markdown(res)
    lines += fused_markdown(res)
    lines += checkpoint_markdown(res)
    lines += mixed_checkpoint_markdown(res)
    lines += engine_markdown(res)
    lines += steady_markdown(res)
    lines += fp8_markdown(res)
    lines += lora_markdown(res)
    lines += decode_markdown(res)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU (Triton interpreted)")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=420.0,
        help="skip the cases that would start after this many seconds",
    )
    p.add_argument("--skip-engine", action="store_true", help="bandwidth, attention and fused kernels only")
    p.add_argument("--skip-checkpoint", action="store_true", help="no real-checkpoint graphs vs eager check")
    p.add_argument("--skip-hf-compiled", action="store_true", help="no transformers static cache + compile")
    p.add_argument("--skip-hot-path", action="store_true", help="no steady-serving and FP8 sections")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "results")
    args = p.parse_args()
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("gpu_bench needs a CUDA device (--smoke runs tiny sizes on CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, when triton is imported
    import triton

    sizes = dict(
        SMOKE if args.smoke else FULL,
        skip_hf_compiled=args.skip_hf_compiled,
        skip_checkpoint=args.skip_checkpoint,
    )
    device = torch.device("cuda" if cuda else "cpu")
    res = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "smoke": args.smoke,
        "git": git_short(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "model": dataclasses.asdict(sizes["model"]),
        "dtype": str(sizes["dtype"]).removeprefix("torch."),
        "args": vars(args),
    }
    out_dir, stem = Path(args.out_dir), "gpu_bench_smoke" if args.smoke else "gpu_bench"

    def save() -> None:  # after every case: a run cut short keeps what it measured
        res["elapsed_s"] = time.perf_counter() - t0
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2, default=str))
        try:
            table = markdown(res)
        except Exception as exc:  # noqa: BLE001 - a table bug must not cost the measurements
            traceback.print_exc()
            table = f"markdown failed: {type(exc).__name__}: {exc}; see {stem}.json\n"
        (out_dir / f"{stem}.md").write_text(table)

    print(
        f"{res['device']}: torch {torch.__version__}, triton {triton.__version__}, git {res['git']}",
        flush=True,
    )
    deadline = t0 + args.time_budget_s
    # The hot-path sections first (what no GPU session has measured yet), so a session's deadline
    # cuts the sections measured before: bandwidth (their denominator), the decode-step kernels
    # (benchmarks/gpu_decode.py), steady serving with async scheduling (benchmarks/gpu_steady.py),
    # FP8 (benchmarks/gpu_fp8.py), then the rest.
    sections = [("bandwidth", bandwidth_section)]
    hot = not args.skip_hot_path
    if hot:
        sections.append(("decode", decode_section))
        if not args.skip_engine:
            sections += [("steady", steady_section), ("fp8", fp8_section), ("lora", lora_section)]
    sections += [
        ("fused", lambda *a: fused_section(*a, time_ms)),
        ("attention", attention_section),
    ]
    if not args.skip_checkpoint:
        sections.append(("checkpoint", checkpoint_section))
        if hot:
            sections.append(("mixed_checkpoint", mixed_checkpoint_section))  # benchmarks/gpu_mixed.py
    if not args.skip_engine:
        sections += [("engine", engine_section), ("roofline", roofline_section)]
    for name, section in sections:
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
            section(res, sizes, device, deadline, save)
        except Exception as exc:  # noqa: BLE001 - one failing section must not cost the others
            traceback.print_exc()
            res.setdefault("section_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"section {name} failed: {res['section_errors'][name]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    print("\n" + open(out_dir / f"{stem}.md").read())
    print(f"wrote {out_dir / stem}.json and .md in {res['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
