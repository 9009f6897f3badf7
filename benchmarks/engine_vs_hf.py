"""`make bench`: engine vs transformers `generate` on the same prompts, same dtype, greedy.

Protocol (docs/metrics.md): a seeded workload of >= 64 prompts with mixed prompt lengths
(~16-512 tokens) and output lengths (~16-256), fixed per request (ignore_eos). The engine takes
them all at once (continuous batching) and generates exactly the requested tokens.
transformers runs static batches (left padding); a static batch generates up to its LONGEST
requested output (`min_new_tokens`), so every shorter request in it costs padding work. It runs
twice, at the same batch size (its best among 8, 16 and 32, chosen by a short calibration on the
first prompts, length-sorted):
- fair (the headline): requests sorted by requested output length, then prompt length, before
  batching, so each batch holds near-equal lengths and little work is wasted (an oracle order:
  transformers' best case);
- padded: requests in workload order, the usual naive way, where at batch 8 about half of the
  generated tokens are padding.
Each run is credited two ways: requested tokens / time (what was asked for; the engine's figure
is this) and generated tokens / time (work actually done, padding included:
`sum over batches of batch size x longest output in it`, see `batch_credit`). The headline ratio
is engine requested tok/s / transformers fair requested tok/s; the padded ratio is printed too,
labelled. Each side runs in its own subprocess so peak RSS is its own. Prints output tokens/s,
`ratio N.NNx`, peak memory, and how many requests agree token for token (the correctness guard).
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

from benchmarks.report import git_short

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
    "matches in distant mountain villages near rivers of gold and silver light"
).split()


def workload(n: int, seed: int) -> list[tuple[str, int, int]]:
    """(text, prompt_tokens_target, output_tokens) per request; lengths log-uniform."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len = int(round(2 ** rng.uniform(4, 9)))  # 16..512
        output_len = int(round(2 ** rng.uniform(4, 8)))  # 16..256
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
    import torch

    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.types import SamplingParams

    # num_threads explicitly: the runner sets torch's thread count from its config (default: every
    # core it is given), which would override the --num-threads both sides are meant to share.
    engine = LLMEngine(
        EngineConfig(
            dtype=dtype,
            kv_cache_bytes=args.kv_cache_mib * 2**20,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_threads=args.num_threads or None,
        )
    )
    assert args.num_threads == 0 or torch.get_num_threads() == args.num_threads, torch.get_num_threads()
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.generate([prompts[0][:32]], warm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    result = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "outputs": result,
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "kv_blocks": engine.block_manager.num_blocks,
    }


def length_sorted_order(prompts: list[list[int]], outputs: list[int]) -> list[int]:
    """Request indices sorted by requested output length, then prompt length (then index)."""
    return sorted(range(len(outputs)), key=lambda i: (outputs[i], len(prompts[i]), i))


def batch_credit(outputs: list[int], batch_size: int, order: list[int] | None = None) -> dict:
    """Tokens a static-batch run is credited with vs the work it does.

    Batches are consecutive runs of `batch_size` requests in `order` (default: as given). Each
    batch generates its longest requested output for every member, so `generated` counts
    len(batch) x max(outputs in batch); `requested` is what was asked for; `padding_fraction` is
    the share of generated tokens nobody asked for."""
    order = list(range(len(outputs))) if order is None else order
    requested = sum(outputs[i] for i in order)
    generated = 0
    for b in range(0, len(order), batch_size):
        batch = [outputs[i] for i in order[b : b + batch_size]]
        generated += len(batch) * max(batch)
    return {
        "requested_tokens": requested,
        "generated_tokens": generated,
        "padding_fraction": 1 - requested / generated if generated else 0.0,
    }


def hf_batches(model, prompts, outputs, batch_size: int, order: list[int] | None = None) -> list[list[int]]:
    """Static batches of `batch_size` requests taken in `order`; results in request order."""
    import torch

    order = list(range(len(prompts))) if order is None else order
    results: dict[int, list[int]] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        batch, lens = [prompts[i] for i in idx], [outputs[i] for i in idx]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=2,
            )
        for i, n, row in zip(idx, lens, gen.tolist()):
            results[i] = row[width : width + n]
    return [results[i] for i in sorted(results)]


def dense_hf_model(dtype: str):
    """transformers' LlamaForCausalLM with the same dequantized weights as the engine: a plain dense
    model, as users run it (transformers' own GGUF path keeps weights packed and casts per matmul)."""
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.gpu_engine import hf_llama_config
    from common.model_files import default_model_path, read_gguf_metadata
    from worker.model.checkpoint import gguf_model_config, load_gguf_weights

    path = default_model_path()
    cfg = gguf_model_config(read_gguf_metadata(path))
    hf_cfg = hf_llama_config(cfg, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    weights = {f"model.{k}": v for k, v in load_gguf_weights(path, cfg).items()}
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)  # rebuild from meta
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return model.to(torch_dtype).eval()


def run_hf(prompts, outputs, dtype: str, args) -> dict:
    model = dense_hf_model(dtype)
    model.generation_config.eos_token_id = None
    hf_batches(model, [prompts[0][:32]], [4], 1)  # warm-up
    calib = {}
    n_cal = args.calibration_prompts
    sub_p, sub_o = prompts[:n_cal], [min(o, 48) for o in outputs[:n_cal]]
    sub_order = length_sorted_order(sub_p, sub_o)
    for bs in args.hf_batch_sizes:
        start = time.perf_counter()
        hf_batches(model, sub_p, sub_o, bs, sub_order)
        calib[bs] = round(sum(sub_o) / (time.perf_counter() - start), 1)
    best = max(calib, key=calib.get)
    res = {"batch_size": best, "calibration_tok_s": calib, "runs": {}}
    orders = {"sorted": length_sorted_order(prompts, outputs), "workload": list(range(len(prompts)))}
    for name in ["sorted", "workload"] if args.hf_order == "both" else [args.hf_order]:
        start = time.perf_counter()
        result = hf_batches(model, prompts, outputs, best, orders[name])
        res["runs"][name] = {
            "elapsed_s": time.perf_counter() - start,
            "outputs": result,
            **batch_credit(outputs, best, orders[name]),
        }
    return res


def side_main(args) -> None:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    prompts, outputs = encode_workload(args.num_prompts, args.seed)
    fn = run_engine if args.side == "engine" else run_hf
    res = fn(prompts, outputs, args.dtype, args)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import torch

    res["torch_threads"] = torch.get_num_threads()  # as the run left it: the same both sides
    json.dump(res, sys.stdout)


ORDER_LABELS = {"sorted": "length-sorted batches", "workload": "workload-order batches"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both sides; bf16 was slower than fp32 below batch 64 on this CPU (measured)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads, both sides (default 1: the sides run one after the other, "
        "and one thread keeps the comparison steady on a shared machine; 0 = torch's default)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-mib", type=int, default=2048)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--calibration-prompts", type=int, default=32)
    p.add_argument(
        "--hf-order",
        choices=["both", "sorted", "workload"],
        default="both",
        help="transformers' batch order: length-sorted (fair, the headline), workload order "
        "(padded), or both (default)",
    )
    p.add_argument("--side", choices=["engine", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/bench_engine.json")
    args = p.parse_args()
    if args.side:
        return side_main(args)
    prompts, outputs = encode_workload(args.num_prompts, args.seed)
    n_out, n_in = sum(outputs), sum(len(x) for x in prompts)
    print(
        f"workload: {len(prompts)} prompts, {n_in} prompt tokens ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))}), {n_out} output tokens ({min(outputs)}-{max(outputs)}), "
        f"seed {args.seed}, dtype {args.dtype}, threads {args.num_threads or 'default'}, "
        f"{os.cpu_count()} CPUs, git {git_short()}"
    )
    results = {}
    for side in ("engine", "hf"):
        cmd = [sys.executable, "-m", "benchmarks.engine_vs_hf", "--side", side] + sys.argv[1:]
        load_before = os.getloadavg()[0]
        print(f"running {side} (load average {load_before:.1f}) ...", flush=True)
        results[side] = json.loads(subprocess.check_output(cmd))
        r = results[side]
        # Both sides share the machine with whatever else runs: a ratio is only as good as the
        # load was equal, so each side's 1-minute load average (start, end) is kept with it.
        r["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        print(f"  ({side} done, load average {r['load_average'][1]:.1f})", flush=True)
        if side == "engine":
            print(
                f"  engine {n_out / r['elapsed_s']:8.1f} output tok/s  {r['elapsed_s']:7.1f} s  "
                f"peak RSS {r['peak_rss_mib']:.0f} MiB  {r['steps']} steps, {r['preemptions']} preemptions, "
                f"{r.get('torch_threads')} torch threads",
                flush=True,
            )
            continue
        print(
            f"  transformers: batch size {r['batch_size']} (calibration tok/s, length-sorted: "
            f"{r['calibration_tok_s']}), peak RSS {r['peak_rss_mib']:.0f} MiB, "
            f"{r.get('torch_threads')} torch threads",
            flush=True,
        )
        for name, run in r["runs"].items():
            print(
                f"  transformers {ORDER_LABELS[name]:34s} {run['requested_tokens'] / run['elapsed_s']:8.1f} "
                f"requested tok/s  {run['generated_tokens'] / run['elapsed_s']:8.1f} generated tok/s "
                f"(work done: {run['generated_tokens']} tokens, {run['padding_fraction']:.0%} padding)  "
                f"{run['elapsed_s']:7.1f} s",
                flush=True,
            )
    eng, hf = results["engine"], results["hf"]
    eng_tok_s = n_out / eng["elapsed_s"]
    summary_runs = {}
    for name, run in hf["runs"].items():
        same = sum(a == b for a, b in zip(eng["outputs"], run["outputs"]))
        prefix = (
            sum(
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(eng["outputs"], run["outputs"])
            )
            / n_out
        )
        summary_runs[name] = {k: v for k, v in run.items() if k != "outputs"}
        summary_runs[name].update(
            requested_tok_s=run["requested_tokens"] / run["elapsed_s"],
            generated_tok_s=run["generated_tokens"] / run["elapsed_s"],
            ratio=eng_tok_s / (run["requested_tokens"] / run["elapsed_s"]),
            identical_requests=same,
            prefix_fraction=prefix,
        )
    headline = "sorted" if "sorted" in summary_runs else "workload"
    for name in [headline] + [n for n in summary_runs if n != headline]:
        r = summary_runs[name]
        label = "headline, fair" if name == "sorted" else ("padded" if name == "workload" else name)
        print(
            f"{'' if name == headline else '  ['}engine {eng_tok_s:.1f} tok/s vs transformers "
            f"{r['requested_tok_s']:.1f} tok/s ({ORDER_LABELS[name]}, {label}): ratio {r['ratio']:.2f}x"
            f"{'' if name == headline else ']'}"
        )
    for name, r in summary_runs.items():
        print(
            f"correctness guard ({ORDER_LABELS[name]}): {r['identical_requests']}/{len(prompts)} requests "
            f"token-identical, {r['prefix_fraction']:.1%} of output tokens before the first divergence"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    summary = {
        "args": vars(args),
        "git": git_short(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "output_tokens": n_out,
        "prompt_tokens": n_in,
        "ratio": summary_runs[headline]["ratio"],
        "ratio_basis": ORDER_LABELS[headline],
        "ratio_padded": summary_runs.get("workload", {}).get("ratio"),
        "identical_requests": summary_runs[headline]["identical_requests"],
        "engine": {k: v for k, v in eng.items() if k != "outputs"} | {"output_tok_s": eng_tok_s},
        "hf": {k: v for k, v in hf.items() if k != "runs"} | {"runs": summary_runs},
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
