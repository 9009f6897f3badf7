"""`make bench-gpu`: paged decode attention vs memory bandwidth, engine decode vs transformers.

Protocol (one GPU, no download: a randomly initialised Llama-3.2-1B-shaped model in bf16):
1. Copy bandwidth: a 4 GiB float32 device-to-device `copy_`, counted as bytes read + bytes written.
2. Decode attention at batch sizes 1-256 and contexts 512-32k (the model's 32 query / 8 kv heads,
   head_dim 64): our Triton paged kernel over randomly permuted 16-token blocks, and
   `F.scaled_dot_product_attention` on the same K/V laid out contiguously. Bandwidth = bytes of K
   and V read / time; the paged kernel's share of the copy bandwidth is the figure of merit
   (target >= 70% at long contexts). Each kernel is recorded in a CUDA graph and timed with
   `triton.testing.do_bench` (median, L2 flushed before every replay), so launch overhead is
   excluded on both sides. The paged output is checked against SDPA's (max relative error).
2b. Fused RMSNorm and RoPE kernels vs the model's torch code (benchmarks/gpu_fused.py), at 1 to
   4,096 tokens: whether they pay off, as the issue asks.
3. Engine vs transformers: the same random weights in our engine (CUDA graphs, then eager) and in
   `LlamaForCausalLM.generate` (greedy, static batch). Each batch size runs every side twice: one
   output token (t_1, mostly prefill) and N tokens (t_N); decode tok/s = B * (N - 1) / (t_N - t_1),
   end-to-end tok/s = B * N / t_N. Prefix caching is off so every run prefills. The engine's
   tokens are compared with transformers' (reported, not asserted: bf16 near-ties may differ).
Results go to `$OUT` (else results/) as gpu_bench.json and gpu_bench.md, rewritten after every
case so a run cut short keeps what it measured; a case that fails is recorded and skipped. `--smoke` runs tiny sizes (on CPU with Triton
interpreted) so CI exercises this script; `--time-budget-s` skips whatever would start too late.
Imports only torch, triton, transformers and worker modules that need nothing else.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_fused import fused_markdown, fused_section
from worker.config import EngineConfig, ModelConfig
from worker.engine import LLMEngine
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                       num_heads=32, num_kv_heads=8, head_dim=64, max_position=131072,
                       rope_theta=500000.0, name="random-llama-3.2-1b-shape")
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position=512, name="random-tiny")
FULL = dict(model=LLAMA_1B, dtype=torch.bfloat16, copy_bytes=2**32, attn_batch_sizes=[1, 4, 16, 64, 256],
            contexts=[512, 2048, 8192, 32768], engine_batch_sizes=[1, 16, 64, 256], prompt_len=128,
            fused_tokens=[1, 16, 64, 256, 4096], output_len=128, max_num_batched_tokens=8192, max_model_len=2048)
SMOKE = dict(model=TINY, dtype=torch.float32, copy_bytes=2**23, attn_batch_sizes=[1, 2],
             contexts=[32, 80], engine_batch_sizes=[1, 2], prompt_len=8, output_len=4, fused_tokens=[1, 8],
             max_num_batched_tokens=64, max_model_len=64)
BLOCK_SIZE = 16
LONG_CONTEXT = 8192
TARGET_COPY_FRACTION = 0.70


def time_ms(fn, device: torch.device) -> tuple[float, str]:
    """Median time of fn in ms and how it was timed (graph replay where possible)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), "cpu wall clock"
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:     # not capturable: time eagerly, launch overhead included
        return do_bench(fn, warmup=10, rep=50, return_mode="median"), f"eager ({exc})"[:120]
    return do_bench(graph.replay, warmup=10, rep=50, return_mode="median"), "cuda graph"


def copy_bandwidth(num_bytes: int, device: torch.device) -> dict:
    src = torch.randn(num_bytes // 4, device=device)          # float32: vectorized like K/V reads
    dst = torch.empty_like(src)
    ms, how = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": num_bytes, "ms": ms, "gbps": 2 * num_bytes / ms / 1e6, "timed_by": how}


def attention_case(batch: int, context: int, cfg: ModelConfig, dtype, device) -> dict:
    from worker.kernels.triton_attention import paged_attention

    hkv, d = cfg.num_kv_heads, cfg.head_dim
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, cfg.num_heads, d, generator=gen, device=device, dtype=dtype)  # (B, H, D)
    out = torch.empty_like(q)
    scale = d ** -0.5
    paged = functools.partial(paged_attention, q, k_cache, v_cache, block_tables, seq_lens,
                              query_start_loc, scale, max_query_len=1, max_seq_len=context, out=out)
    paged_ms, paged_how = time_ms(paged, device)                # leaves the result in `out`
    kv_bytes = 2 * batch * context * hkv * d * q.element_size()
    row = {"batch_size": batch, "context_len": context, "kv_bytes": kv_bytes,
           "paged_us": paged_ms * 1e3, "paged_gbps": kv_bytes / paged_ms / 1e6,
           "timed_by": {"paged": paged_how}}
    del paged

    def contiguous(cache):                                     # (B, Hkv, L, D): one run per sequence
        return cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    try:
        # Each paged cache goes as soon as its contiguous copy exists: 256 x 32k is 8 GiB a copy.
        k = contiguous(k_cache)
        del k_cache
        v = contiguous(v_cache)
        del v_cache
        q4 = q[:, :, None, :]                                  # (B, H, 1, D)
        sdpa_out = torch.empty_like(q4)

        def sdpa():
            sdpa_out.copy_(F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

        sdpa_ms, row["timed_by"]["sdpa"] = time_ms(sdpa, device)
    except Exception as exc:   # noqa: BLE001 - e.g. OOM in a fallback that repeats K/V per head,
        # or a torch without enable_gqa: the paged figures stand on their own
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    ref = sdpa_out[:, :, 0].float()
    row.update(sdpa_us=sdpa_ms * 1e3, sdpa_gbps=kv_bytes / sdpa_ms / 1e6,
               max_rel_err_vs_sdpa=float((out.float() - ref).abs().max() / ref.abs().max()))
    return row


def build_models(cfg: ModelConfig, dtype, device) -> tuple[LlamaModel, object, str | None]:
    """Our model and transformers' on the same random weights; (ours, None, why) without HF."""
    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as exc:     # noqa: BLE001 - transformers fails on a missing dependency
        hf, why = None, f"transformers unavailable: {type(exc).__name__}: {exc}"
    else:
        hf_config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                intermediate_size=cfg.intermediate_size,
                                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                max_position_embeddings=cfg.max_position, rope_theta=cfg.rope_theta,
                                rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings)
        with torch.device(device):
            hf = LlamaForCausalLM(hf_config)
        hf = hf.to(dtype).eval()
        hf.generation_config.eos_token_id = None
        why = None
    with torch.device(device):
        ours = LlamaModel(cfg)
    ours = ours.to(dtype).eval()
    if hf is not None:
        ours.load_hf_state_dict(hf.state_dict())
    ours.reset_rope()                         # float32 tables, whatever the weights' dtype
    return ours, hf, why


def run_hf(hf, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=hf.device)
    start = time.perf_counter()
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    tokens = gen[:, ids.shape[1]:].tolist()                     # waits for the device
    return time.perf_counter() - start, tokens


def engine_run_fn(model: LlamaModel, sizes: dict, device: torch.device, enforce_eager: bool):
    config = EngineConfig(device=str(device), dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
                          kv_cache_bytes=64 * 2**20, gpu_memory_utilization=0.1,
                          max_num_seqs=max(sizes["engine_batch_sizes"]),
                          max_num_batched_tokens=sizes["max_num_batched_tokens"],
                          max_model_len=sizes["max_model_len"], enable_prefix_caching=False,
                          attention_backend="triton", enforce_eager=enforce_eager)
    engine = LLMEngine(config, runner=ModelRunner.from_model(config, model, name=model.config.name))
    assert (engine.runner.cuda_graphs is None) == (enforce_eager or device.type != "cuda")

    def run(prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len,
                                                         ignore_eos=True))
        return time.perf_counter() - start, tokens
    return run


def throughput(run, prompts: list[list[int]], output_len: int) -> tuple[dict, list[list[int]]]:
    t_1, _ = run(prompts, 1)
    t_n, tokens = run(prompts, output_len)
    b = len(prompts)
    decode_s = t_n - t_1                  # noise can swamp a tiny smoke run: then no figure
    return {"t_1_s": t_1, "t_n_s": t_n, "e2e_tok_s": b * output_len / t_n,
            "decode_tok_s": b * (output_len - 1) / decode_s if decode_s > 0 else None}, tokens


def agreement(ours: list[list[int]] | None, ref: list[list[int]] | None) -> dict:
    if ours is None or ref is None:
        return {}
    return {"identical": sum(a == b for a, b in zip(ours, ref)),
            "first_token_equal": sum(a[:1] == b[:1] for a, b in zip(ours, ref)), "requests": len(ref)}


def engine_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    cfg, batch_sizes, output_len = sizes["model"], sizes["engine_batch_sizes"], sizes["output_len"]
    model, hf, hf_missing = build_models(cfg, sizes["dtype"], device)
    setup = {k: sizes[k] for k in ("prompt_len", "output_len", "max_num_batched_tokens", "max_model_len")}
    setup["transformers"] = sys.modules["transformers"].__version__ if hf is not None else hf_missing
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, sizes["prompt_len"]), generator=gen).tolist()
               for b in batch_sizes + [2]}
    rows = {b: {"batch_size": b} for b in batch_sizes}
    res["engine_setup"], res["engine"] = setup, list(rows.values())
    sides = (["graphs"] if device.type == "cuda" else []) + ["eager"] + (["hf"] if hf else [])
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for side in sides:
        run = None
        try:
            start = time.perf_counter()
            run = (functools.partial(run_hf, hf) if side == "hf"
                   else engine_run_fn(model, sizes, device, enforce_eager=side == "eager"))
            setup[f"{side}_setup_s"] = time.perf_counter() - start
            run(prompts[2], 4)                                     # warm-up: Triton compiles
            for b in batch_sizes:
                if time.perf_counter() > deadline:
                    rows[b][side] = {"skipped": "time budget"}
                    continue
                rows[b][side], tokens[side, b] = throughput(run, prompts[b], output_len)
                print(f"  {side:6s} batch {b:4d}: decode {fmt(rows[b][side]['decode_tok_s'], '10.1f')} "
                      f"tok/s, end to end {rows[b][side]['e2e_tok_s']:10.1f} tok/s", flush=True)
        except Exception as exc:   # noqa: BLE001 - one failing side must not cost the others' numbers
            traceback.print_exc()
            setup[f"{side}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        del run                    # frees this engine's KV pool before the next side allocates one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    engine_side = "graphs" if device.type == "cuda" else "eager"
    for b, row in rows.items():
        # Correctness guards: the engine against transformers, graph replay against eager.
        row["agreement_vs_hf"] = agreement(tokens.get((engine_side, b)), tokens.get(("hf", b)))
        if engine_side == "graphs":
            row["graphs_vs_eager"] = agreement(tokens.get(("graphs", b)), tokens.get(("eager", b)))


def attention_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    res["copy"] = copy_bandwidth(sizes["copy_bytes"], device)
    copy_gbps = res["copy"]["gbps"]
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    res["attention"] = []
    for batch in sizes["attn_batch_sizes"]:
        for context in sizes["contexts"]:
            row = {"batch_size": batch, "context_len": context}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
            else:
                try:
                    row = attention_case(batch, context, sizes["model"], sizes["dtype"], device)
                except Exception as exc:   # noqa: BLE001 - e.g. out of memory: keep the other cases
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res["attention"].append(row)
            if "paged_us" in row:
                row["copy_fraction"] = row["paged_gbps"] / copy_gbps
                print(f"  attention batch {batch:4d} context {context:6d}: paged {row['paged_us']:9.1f} us "
                      f"{row['paged_gbps']:6.0f} GB/s ({row['copy_fraction']:4.0%} of copy); SDPA "
                      f"{fmt(row.get('sdpa_us'), '9.1f')} us {fmt(row.get('sdpa_gbps'), '6.0f')} GB/s; "
                      f"rel err {fmt(row.get('max_rel_err_vs_sdpa'), '.1e')}", flush=True)
            save()
    fractions = [r["copy_fraction"] for r in res["attention"]
                 if r["context_len"] >= LONG_CONTEXT and "copy_fraction" in r]
    if fractions:
        res["summary"] = {"long_context_copy_fraction_min": min(fractions),
                          "long_context_copy_fraction_max": max(fractions),
                          "long_context_cases": len(fractions),
                          "long_context_target_met": sum(f >= TARGET_COPY_FRACTION for f in fractions)}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    lines = [f"# GPU bench: {res['device']}, {res['model']['name']}, {res['dtype']}", "",
             f"Device-to-device copy: {fmt(res.get('copy', {}).get('gbps'), '.0f')} GB/s "
             "(read + write). Decode attention, one query token per sequence, "
             f"{res['model']['num_heads']} query / {res['model']['num_kv_heads']} kv heads, "
             f"head_dim {res['model']['head_dim']}:", "",
             "| batch | context | K/V MiB | paged us | paged GB/s | % of copy | SDPA us | SDPA GB/s "
             "| SDPA time / paged time | max rel err |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.get("attention", []):
        if "paged_us" not in r:
            lines.append(f"| {r['batch_size']} | {r['context_len']} | "
                         f"{r.get('error') or r.get('skipped')} | | | | | | | |")
            continue
        speedup = r["sdpa_us"] / r["paged_us"] if "sdpa_us" in r else None
        lines.append(f"| {r['batch_size']} | {r['context_len']} | {r['kv_bytes'] / 2**20:.1f} | "
                     f"{r['paged_us']:.1f} | {r['paged_gbps']:.0f} | {r['copy_fraction']:.0%} | "
                     f"{fmt(r.get('sdpa_us'), '.1f')} | {fmt(r.get('sdpa_gbps'), '.0f')} | "
                     f"{fmt(speedup, '.2f')}x | "
                     f"{r.get('sdpa_error', fmt(r.get('max_rel_err_vs_sdpa'), '.1e'))[:80]} |")
    s = res.get("summary")
    if s:
        lines += ["", f"Long contexts (>= {LONG_CONTEXT}): paged attention reaches "
                  f"{s['long_context_copy_fraction_min']:.0%}-{s['long_context_copy_fraction_max']:.0%} "
                  f"of copy bandwidth; target >= {TARGET_COPY_FRACTION:.0%} met in "
                  f"{s['long_context_target_met']}/{s['long_context_cases']} cases."]
    lines += fused_markdown(res)
    if "engine" in res:
        e = res["engine_setup"]
        errors = [f"{k}: {v}" for k, v in e.items() if k.endswith("_error")]
        lines += ["", f"Engine vs transformers ({e['transformers']}), greedy, prompt {e['prompt_len']} "
                  f"+ {e['output_len']} output tokens per request, tok/s. decode = B * (N - 1) / "
                  "(t_N - t_1); e2e = B * N / t_N.", *errors, "",
                  "| batch | graphs decode | eager decode | HF decode | engine / HF decode "
                  "| graphs e2e | eager e2e | HF e2e | identical to HF | graphs identical to eager |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["engine"]:
            g, eager, hf = (r.get(k, {}) for k in ("graphs", "eager", "hf"))
            best = g.get("decode_tok_s") or eager.get("decode_tok_s")
            ratio = best / hf["decode_tok_s"] if best and hf.get("decode_tok_s") else None
            agree, replay = r.get("agreement_vs_hf") or {}, r.get("graphs_vs_eager") or {}
            lines.append(f"| {r['batch_size']} | {fmt(g.get('decode_tok_s'), '.0f')} | "
                         f"{fmt(eager.get('decode_tok_s'), '.0f')} | {fmt(hf.get('decode_tok_s'), '.0f')} | "
                         f"{fmt(ratio, '.2f')}x | {fmt(g.get('e2e_tok_s'), '.0f')} | "
                         f"{fmt(eager.get('e2e_tok_s'), '.0f')} | {fmt(hf.get('e2e_tok_s'), '.0f')} | "
                         f"{agree.get('identical', '-')}/{agree.get('requests', '-')} | "
                         f"{replay.get('identical', '-')}/{replay.get('requests', '-')} |")
    return "\n".join(lines) + "\n"


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU (Triton interpreted)")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="skip the cases that would start after this many seconds")
    p.add_argument("--skip-engine", action="store_true", help="copy and attention only")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "results")
    args = p.parse_args()
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("gpu_bench needs a CUDA device (--smoke runs tiny sizes on CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # read once, when triton is imported
    import triton

    sizes = SMOKE if args.smoke else FULL
    device = torch.device("cuda" if cuda else "cpu")
    res = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "smoke": args.smoke, "git": git_rev(), "torch": torch.__version__,
           "triton": triton.__version__, "model": dataclasses.asdict(sizes["model"]),
           "dtype": str(sizes["dtype"]).removeprefix("torch."), "args": vars(args)}
    out_dir, stem = Path(args.out_dir), "gpu_bench_smoke" if args.smoke else "gpu_bench"

    def save() -> None:                 # after every case: a run cut short keeps what it measured
        res["elapsed_s"] = time.perf_counter() - t0
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2))
        (out_dir / f"{stem}.md").write_text(markdown(res))

    print(f"{res['device']}: torch {torch.__version__}, triton {triton.__version__}, git {res['git']}",
          flush=True)
    deadline = t0 + args.time_budget_s
    attention_section(res, sizes, device, deadline, save)
    fused_section(res, sizes, device, deadline, save, time_ms)
    if not args.skip_engine:
        engine_section(res, sizes, device, deadline, save)
    save()
    print("\n" + markdown(res))
    print(f"wrote {out_dir / stem}.json and .md in {res['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
