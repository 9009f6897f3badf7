"""Where a decode step's time goes on the GPU: kernel time per step by kernel, against wall time.

Protocol: the random Llama-3.2-1B-shaped model of `make bench-gpu` (bf16, benchmarks/gpu_bench.py
FULL sizes) in one engine (benchmarks/gpu_steady.make_engine) per variant: bf16 with CUDA graphs,
bf16 with `--triton-gemv` (decoder linears of <= 16 rows in the Triton GEMV where startup timing
chose it), fp8 with graphs (W8A16 GEMV at decode where timing chose it, W8A8 otherwise), bf16
eager. For each batch size B, B random prompts of `prompt_len` tokens
(seeded) run twice under torch.profiler (CPU + CUDA activities): for 1 output token and for
1 + `steps` output tokens. Per kernel name, (time in the long run - time in the short run) / steps
is the kernel time one decode step spends in it; the same difference of wall time is the step's
wall time. `kernel sum / wall` near 1 means the GPU is busy all step (the kernels are the limit);
well under 1 means it waits on the host (launches, Python, syncs).

Output: a markdown table per (variant, batch) on stdout and `gpu_profile.json` + `gpu_profile.md`
in --out-dir: the top kernels (us per step, calls per step, share of kernel time), kernel sum,
wall step time, the share of the step the GPU is busy. Each case runs in its own try (a failure is
recorded and the rest still runs) and the files are rewritten after every case.
`--smoke` runs tiny sizes on CPU (CPU kernels instead of CUDA ones) so a test can check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import traceback
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from worker.types import SamplingParams

# In the order a short GPU session needs them (the time budget cuts the last).
VARIANTS = [
    ("bf16 graphs", {}),
    ("bf16 graphs + triton gemv", dict(triton_gemv=True)),
    ("fp8 graphs", dict(quantization="fp8")),
    ("bf16 eager", dict(enforce_eager=True)),
]


def _kernel_times(prof, device_type: str) -> dict[str, tuple[float, int]]:
    """Per kernel name: (total device us, calls), from the profiler's device events."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if device_type == "cuda":
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.device_time
        else:  # CPU smoke: the aten ops' own CPU time stands in for kernels
            if evt.cpu_parent is not None or not evt.name.startswith("aten::"):
                continue
            us = evt.cpu_time_total
        out[evt.name][0] += us
        out[evt.name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _profiled(engine, prompts: list[list[int]], n: int, device: torch.device):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return _kernel_times(prof, device.type), wall


def profile_case(engine, batch: int, sizes: dict, steps: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(
        0, sizes["model"].vocab_size, (batch, sizes["prompt_len"]), generator=gen
    ).tolist()
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    short, wall_1 = _profiled(engine, prompts, 1, device)
    long, wall_n = _profiled(engine, prompts, 1 + steps, device)
    per_step = {}
    for name, (us, calls) in long.items():
        us0, calls0 = short.get(name, (0.0, 0))
        d_us, d_calls = (us - us0) / steps, (calls - calls0) / steps
        if d_calls > 0:  # launched by the decode steps (counts are exact; times can be noise-negative)
            per_step[name] = (max(d_us, 0.0), d_calls)
    kernel_us = sum(us for us, _ in per_step.values())
    wall_us = (wall_n - wall_1) / steps * 1e6
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:15]
    return dict(
        batch_size=batch,
        steps=steps,
        wall_step_us=wall_us,
        kernel_step_us=kernel_us,
        gpu_busy=kernel_us / wall_us if wall_us > 0 else None,
        kernels_per_step=sum(c for _, c in per_step.values()),
        top=[
            dict(name=k[:90], us=v[0], calls=v[1], share=v[0] / kernel_us if kernel_us else None)
            for k, v in top
        ],
    )


def markdown(cases: list[dict]) -> str:
    lines = ["# Decode step profile (benchmarks/gpu_profile.py)", ""]
    for c in cases:
        if "error" in c:
            lines += [f"## {c['variant']} batch {c.get('batch_size')}: failed: {c['error']}", ""]
            continue
        lines += [
            f"## {c['variant']}, batch {c['batch_size']}: wall {c['wall_step_us']:.0f} us per decode step, "
            f"kernels {c['kernel_step_us']:.0f} us ({c['kernels_per_step']:.0f} launches), "
            f"GPU busy {100 * (c['gpu_busy'] or 0):.0f}%",
            "",
            "| kernel | us per step | calls per step | share of kernel time |",
            "|---|---:|---:|---:|",
        ]
        for t in c["top"]:
            lines.append(
                f"| `{t['name']}` | {t['us']:.1f} | {t['calls']:.1f} | {100 * (t['share'] or 0):.1f}% |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="results")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (plumbing check)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--time-budget-s", type=float, default=150.0)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, when triton is imported
    from benchmarks.gpu_bench import FULL, SMOKE
    from benchmarks.gpu_steady import make_engine, random_model

    sizes = SMOKE if args.smoke else FULL
    # Graphs, the GEMV and fp8 need CUDA: on CPU only the eager variant.
    variants = [v for v in VARIANTS if v[1].get("enforce_eager")] if device.type == "cpu" else VARIANTS
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.time_budget_s
    cases: list[dict] = []

    def save() -> None:
        (out / "gpu_profile.json").write_text(json.dumps(cases, indent=1))
        (out / "gpu_profile.md").write_text(markdown(cases))

    for name, extra in variants:
        try:
            model = random_model(sizes, device)
            if extra.get("quantization") == "fp8":
                from worker.model.fp8 import quantize_model_fp8

                quantize_model_fp8(model)
            batches = [int(b) for b in args.batches.split(",")]
            engine = make_engine(model, device, max(batches), 2048, **extra)
        except Exception as exc:  # recorded; the other variants still run
            cases.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"))
            traceback.print_exc()
            save()
            continue
        for b in batches:
            if time.perf_counter() > deadline:
                cases.append(dict(variant=name, batch_size=b, error="skipped: time budget"))
                continue
            try:
                cases.append(dict(variant=name, **profile_case(engine, b, sizes, args.steps, device)))
            except Exception as exc:  # recorded; the other cases still run
                cases.append(dict(variant=name, batch_size=b, error=f"{type(exc).__name__}: {exc}"))
                traceback.print_exc()
            save()
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(cases))


if __name__ == "__main__":
    main()
