"""`make bench-gpu` section "decode": the decode step's new kernels, alone and in the engine (issue 19).

Protocol (results in the gpu_bench result dict, `res["decode"]`, saved after every case):
1. `gemv`: Triton GEMV vs cuBLAS per projection shape of the benchmark model at 1, 4 and 16 rows
   (benchmarks/gpu_gemv.py: weights cycled through >= 256 MiB so they come from DRAM, CUDA-graph
   timing, best candidate config; us, GB/s, % of the measured read bandwidth), and for 16-bit
   models the fp8 weight GEMV (W8A16) vs `Fp8Linear`'s W8A8 path (`_scaled_mm`) per shape, and
   the per-group fp8 form (one scale per row and 128 columns, the default): its GEMV at those rows
   and its Triton GEMM (worker/kernels/triton_fp8_gemm.py) at 64 and 512 rows.
2. `sampling`: the fused sampling kernel vs the torch sampler (benchmarks/gpu_sampling.py:
   temperature 0.8, top-k 50, top-p 0.95 from bf16 logits) at the model's vocabulary and at
   128,256 (Llama 3), batch 1, 64 and 256.
3. `engine`: the random benchmark model in the engine (CUDA graphs, prompt P + N output tokens, as
   the engine section), decode step time by lockstep (gpu_steady.lockstep: (t_N - t_1) / (N - 1)),
   and % of the roofline (weight bytes + KV bytes at the mean context, over the measured read
   bandwidth, as the roofline section):
   - greedy at batch 1 and `decode_batch` (64): without, then with `--triton-gemv` (the model pass
     times every projection at startup and keeps the kernel only where it wins);
   - sampled (temperature 0.8, top-p 0.95, seeded) at `decode_batch`: the torch sampler
     (`runner.sampler.fused = None`) vs the fused kernel (the CUDA default);
   - greedy at batch 1 and `decode_batch` with async scheduling (`--async-scheduling`: the host's
     planning, input preparation and output bookkeeping overlap the device step, which the
     synchronous rows above pay in full), without and then with `--triton-gemv` (the last row pair:
     every engine option this issue built that can only add speed).
On CPU (`--smoke`) everything runs at tiny sizes with Triton interpreted (GEMV and fused sampling
forced on), which proves only that the code runs (tests/test_gpu_bench.py).
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_engine import decode_weight_bytes, kv_bytes_per_token, mean_decode_context
from benchmarks.gpu_steady import lockstep, make_engine, random_model
from worker.types import SamplingParams

GEMV_ROWS = (1, 4, 16)
SAMPLED = dict(temperature=0.8, top_p=0.95)


def _roofline(step_bytes, batch: int, step_ms: float | None, read_gbps: float | None):
    """Share of the read bandwidth a decode step of `batch` sequences (`step_bytes(batch)` bytes)
    would need at `step_ms`."""
    if not step_ms or not read_gbps:
        return None
    return step_bytes(batch) / (step_ms * 1e-3) / 1e9 / read_gbps


def _sampled_lockstep(engine, prompts: list[list[int]], n: int) -> dict:
    """`lockstep`'s row with seeded non-greedy sampling (ignore_eos)."""

    def run(tokens: int) -> float:
        params = [
            SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **SAMPLED) for i in range(len(prompts))
        ]
        start = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - start

    t_1, t_n = run(1), run(n)
    step = (t_n - t_1) / (n - 1) * 1e3 if t_n > t_1 and n > 1 else None
    tok_s = len(prompts) / step * 1e3 if step else None
    return dict(batch_size=len(prompts), t_1_s=t_1, t_n_s=t_n, decode_step_ms=step, decode_tok_s=tok_s)


def decode_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    from benchmarks import gpu_gemv, gpu_sampling

    cfg, smoke = sizes["model"], device.type != "cuda"
    out = res["decode"] = {"gemv": [], "sampling": [], "engine": []}
    shapes = gpu_gemv.shapes_of(cfg)
    rows = (1, 2) if smoke else GEMV_ROWS
    # With fp8 rows (16-bit models): the per-channel fp8 GEMV (W8A16) vs Fp8Linear's W8A8 path vs
    # cuBLAS, and the per-group form (the default): its GEMV at decode rows and its GEMM at 64 / 512
    # rows vs F.linear on bf16 weights and vs dequantize + F.linear.
    fp8 = sizes["dtype"] in (torch.bfloat16, torch.float16)
    out["gemv"] = gpu_gemv.gemv_bench(device, shapes, rows=rows, dtype=sizes["dtype"], fp8=fp8, grouped=fp8)
    save()
    if time.perf_counter() < deadline:
        vocabs = (cfg.vocab_size,) if smoke else (cfg.vocab_size, 128256)
        batches = (1, 2) if smoke else (1, 64, 256)
        out["sampling"] = gpu_sampling.sampling_bench(device, vocabs, batches, iters=1 if smoke else 20)
        save()
    p, n = sizes["prompt_len"], sizes["output_len"]
    big = sizes.get("decode_batch", 2 if smoke else 64)
    gen = torch.Generator().manual_seed(7)
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, p), generator=gen).tolist() for b in (1, big)}
    read_gbps = res.get("read", {}).get("gbps")
    model = random_model(sizes, device)
    # The bytes a decode step reads (the GEMV pass below swaps modules, not weights): once.
    weight_bytes, kv_token = decode_weight_bytes(model), kv_bytes_per_token(model)

    def step_bytes(batch: int) -> float:
        return weight_bytes + batch * mean_decode_context(sizes) * kv_token

    # The GEMV pass swaps the model's linears in place: its variants run last.
    variants = ("cublas", "sampled torch", "sampled fused", "async", "triton gemv", "triton gemv + async")
    engine = None
    for variant in variants:
        if time.perf_counter() > deadline:
            out["engine"].append({"variant": variant, "skipped": "time budget"})
            continue
        try:
            extra = {"async_scheduling": True} if variant.endswith("async") else {}
            if variant.startswith("triton gemv"):
                if smoke and variant == "triton gemv":  # the runner times and swaps on CUDA only
                    from worker.model.gemv import use_triton_gemv

                    use_triton_gemv(model, force=True)
                extra["triton_gemv"] = True
            engine = make_engine(model, device, big, 2048, **extra)
            if variant.startswith("sampled"):
                if variant == "sampled torch":
                    engine.runner.sampler.fused = None
                elif smoke:
                    from worker.kernels.triton_sampling import fused_sample

                    engine.runner.sampler.fused = fused_sample
                if sizes.get("warm_up", True):
                    _sampled_lockstep(engine, prompts[1], 3)
                rows = [_sampled_lockstep(engine, prompts[big], n)]
            else:
                if sizes.get("warm_up", True):
                    lockstep(engine, prompts[1], 3)
                rows = [lockstep(engine, prompts[b], n) for b in (1, big)]
            for row in rows:
                b, step = row["batch_size"], row["decode_step_ms"]
                row.update(variant=variant, roofline=_roofline(step_bytes, b, step, read_gbps))
                out["engine"].append(row)
                print(f"  decode {variant} batch {b}: step {step} ms, roofline {row['roofline']}", flush=True)
            save()
        except Exception as exc:  # noqa: BLE001 - one variant failing must not cost the others
            out["engine"].append({"variant": variant, "skipped": f"{type(exc).__name__}: {exc}"[:200]})
        if engine is not None:
            engine.close()  # the async variants' executor thread
        engine = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def decode_markdown(res: dict) -> list[str]:
    from benchmarks import gpu_gemv, gpu_sampling

    r = res.get("decode")
    if not r:
        return []
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["", "**Decode-step kernels** (benchmarks/gpu_decode.py)", ""]
    read = res.get("read", {}).get("gbps")
    if r.get("gemv") and read:
        lines += ["Triton GEMV vs cuBLAS (per call, weights from DRAM):", ""]
        layers = res.get("model", {}).get("num_layers", gpu_gemv.LLAMA_1B_LAYERS)
        lines += gpu_gemv.rows_to_markdown(r["gemv"], read, layers=layers).splitlines()
    if r.get("sampling"):
        lines += ["", "Fused sampling vs the torch sampler (T 0.8, top-k 50, top-p 0.95):", ""]
        lines += gpu_sampling.rows_to_markdown(r["sampling"]).splitlines()
    if r.get("engine"):
        lines += [
            "",
            "In the engine (graphs; greedy unless 'sampled'; roofline: bytes per step / step time / read "
            "bandwidth):",
            "",
            "| variant | batch | decode step ms | decode tok/s | % of roofline |",
            "|---|---:|---:|---:|---:|",
        ]
        for e in r["engine"]:
            if "skipped" in e:
                lines.append(f"| {e['variant']} | - | skipped: {e['skipped']} | | |")
                continue
            roof = e.get("roofline")
            lines.append(
                f"| {e['variant']} | {e['batch_size']} | {f(e.get('decode_step_ms'), '.3f')} | "
                f"{f(e.get('decode_tok_s'), '.0f')} | {'-' if roof is None else f'{roof:.0%}'} |"
            )
    return lines
