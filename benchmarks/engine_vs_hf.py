"""`make bench`: engine vs transformers `generate` on the same prompts, same dtype, greedy.

Protocol (shared/METRICS.md): a seeded workload of >= 64 prompts with mixed prompt lengths
(~16-512 tokens) and output lengths (~16-256), fixed per request (ignore_eos). transformers runs
static batches in workload order (left padding; each batch generates up to its longest requested
output, the usual way to batch it) at its best batch size among 8, 16 and 32, chosen by a short
calibration run on the first prompts. Each side runs in its own subprocess so peak RSS is its own.
Only requested tokens count as output for both. Prints output tokens/s, `ratio N.NNx`, peak memory,
and how many requests agree token for token (the correctness guard).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches in distant mountain villages near rivers of gold and silver light").split()


def workload(n: int, seed: int) -> list[tuple[str, int, int]]:
    """(text, prompt_tokens_target, output_tokens) per request; lengths log-uniform."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len = int(round(2 ** rng.uniform(4, 9)))           # 16..512
        output_len = int(round(2 ** rng.uniform(4, 8)))           # 16..256
        words = [rng.choice(WORDS) for _ in range(prompt_len)]
        out.append((f"Request {i}: " + " ".join(words), prompt_len, output_len))
    return out


def encode_workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    prompts, outputs = [], []
    for text, prompt_len, output_len in workload(n, seed):
        prompts.append(tok.encode(text)[:prompt_len])
        outputs.append(output_len)
    return prompts, outputs


def run_engine(prompts, outputs, dtype: str, args) -> dict:
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_bytes=args.kv_cache_mib * 2**20,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.generate([prompts[0][:32]], warm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    result = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "outputs": result, "steps": engine.num_steps,
            "preemptions": engine.scheduler.num_preemptions,
            "kv_blocks": engine.block_manager.num_blocks}


def hf_batches(model, prompts, outputs, batch_size: int) -> list[list[int]]:
    import torch

    results = []
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b:b + batch_size], outputs[b:b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):                               # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                                 do_sample=False, pad_token_id=2)
        results.extend(gen[i, width:width + n].tolist() for i, n in enumerate(lens))
    return results


def dense_hf_model(dtype: str):
    """transformers' LlamaForCausalLM with the same dequantized weights as the engine: a plain dense
    model, as users run it (transformers' own GGUF path keeps weights packed and casts per matmul)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.model_files import default_model_path, read_gguf_metadata
    from worker.model.loader import gguf_model_config, load_gguf_weights

    path = default_model_path()
    cfg = gguf_model_config(read_gguf_metadata(path))
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position,
                         rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    weights = {f"model.{k}": v for k, v in load_gguf_weights(path, cfg).items()}
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)   # rebuild from meta
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return model.to(torch_dtype).eval()


def run_hf(prompts, outputs, dtype: str, args) -> dict:
    model = dense_hf_model(dtype)
    model.generation_config.eos_token_id = None
    hf_batches(model, [prompts[0][:32]], [4], 1)                 # warm-up
    calib = {}
    n_cal = args.calibration_prompts
    for bs in args.hf_batch_sizes:
        sub_p, sub_o = prompts[:n_cal], [min(o, 48) for o in outputs[:n_cal]]
        start = time.perf_counter()
        hf_batches(model, sub_p, sub_o, bs)
        calib[bs] = round(sum(sub_o) / (time.perf_counter() - start), 1)
    best = max(calib, key=calib.get)
    start = time.perf_counter()
    result = hf_batches(model, prompts, outputs, best)
    return {"elapsed_s": time.perf_counter() - start, "outputs": result, "batch_size": best,
            "calibration_tok_s": calib}


def side_main(args) -> None:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    prompts, outputs = encode_workload(args.num_prompts, args.seed)
    fn = run_engine if args.side == "engine" else run_hf
    res = fn(prompts, outputs, args.dtype, args)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(res, sys.stdout)


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides; bf16 was slower than fp32 below batch 64 on this CPU (measured)")
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads, both sides (default 1: the sides run one after the other, "
                        "and one thread keeps the comparison steady on a shared machine; 0 = torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-mib", type=int, default=2048)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--calibration-prompts", type=int, default=32)
    p.add_argument("--side", choices=["engine", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/bench_engine.json")
    args = p.parse_args()
    if args.side:
        return side_main(args)
    prompts, outputs = encode_workload(args.num_prompts, args.seed)
    n_out, n_in = sum(outputs), sum(len(x) for x in prompts)
    print(f"workload: {len(prompts)} prompts, {n_in} prompt tokens ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))}), {n_out} output tokens ({min(outputs)}-{max(outputs)}), "
          f"seed {args.seed}, dtype {args.dtype}, threads {args.num_threads or 'default'}, "
          f"{os.cpu_count()} CPUs, git {git_rev()}")
    results = {}
    for side in ("engine", "hf"):
        cmd = [sys.executable, "-m", "benchmarks.engine_vs_hf", "--side", side] + sys.argv[1:]
        print(f"running {side} ...", flush=True)
        results[side] = json.loads(subprocess.check_output(cmd))
        r = results[side]
        extra = (f"batch size {r['batch_size']} (calibration tok/s {r['calibration_tok_s']})"
                 if side == "hf" else f"{r['steps']} steps, {r['preemptions']} preemptions")
        print(f"  {side:6s} {n_out / r['elapsed_s']:8.1f} output tok/s  {r['elapsed_s']:7.1f} s  "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB  {extra}", flush=True)
    eng, hf = results["engine"], results["hf"]
    same = sum(a == b for a, b in zip(eng["outputs"], hf["outputs"]))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(eng["outputs"], hf["outputs"])) / n_out
    ratio = hf["elapsed_s"] / eng["elapsed_s"]
    print(f"engine {n_out / eng['elapsed_s']:.1f} tok/s vs transformers {n_out / hf['elapsed_s']:.1f} tok/s: "
          f"ratio {ratio:.2f}x")
    print(f"correctness guard: {same}/{len(prompts)} requests token-identical, "
          f"{prefix:.1%} of output tokens before the first divergence")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    summary = {"args": vars(args), "git": git_rev(), "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "output_tokens": n_out, "prompt_tokens": n_in, "ratio": ratio,
               "identical_requests": same, "engine": {k: v for k, v in eng.items() if k != "outputs"},
               "hf": {k: v for k, v in hf.items() if k != "outputs"}}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
