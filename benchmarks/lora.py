"""LoRA serving side by side: the same PEFT adapter on our stack (`--lora-modules`, the request
names it) and on llama.cpp's llama-server (`--lora`, the adapter converted by llama.cpp's own
convert_lora_to_gguf.py), same base GGUF, same requests; each side's base model too.

Contract
- input: `--model` (GGUF; the embedded SmolLM2 by default), `--threads` (2), `--rank` (16),
  `--concurrency` (1,8: requests in flight), `--requests` (per point: 3 x concurrency), `--tokens`
  (64 output tokens, ignore_eos), `--rounds` (2, the order reversed in the second),
  `--skip-llamacpp`; llama-server built once as for `make bench-serve` (benchmarks/llamacpp.py).
- the adapter: written by `write_adapter` in PEFT's format (adapter_config.json and
  adapter_model.safetensors with PEFT's key names) for the base model's shapes: every layer's
  seven projections, rank `--rank`, alpha 2 x rank, seeded random A ~ N(0, 0.1) and B ~ N(0,
  0.02) (not PEFT's zero B: the answers change wording and stay text, as a fine-tune's would).
  llama-server loads it converted to GGUF (f32) from a config.json written for the base model
  (`hf_config`).
- protocol: a side is started alone (ours: worker + router with the adapter loaded; llama.cpp: one
  server without and one with `--lora`), sent one unmeasured request, then per concurrency
  `--requests` chat completions of the speculative benchmark's questions, closed loop, greedy,
  `--tokens` each (ignore_eos); output tok/s is output tokens over wall time. Each side at its
  defaults (ours drafts n-grams while at most 4 sequences run, for the base model and the adapter
  alike).
- output: per side, model (base / adapter) and concurrency: output tok/s; ratios ours/llama.cpp
  and adapter/base; the greedy agreement of the two sides' adapter outputs (the first tokens,
  as text: two implementations of one adapter over one int4 base, so a wrong scale, shard or
  permutation shows as disagreement from the first token). A JSON file and a markdown table in
  results/ (docs/benchmarks.md, "LoRA adapters side by side"), with the CPU model and revision.
- failure modes: a side that fails to start is reported with its log tail, the others still run.
- proven by: tests/test_lora.py (the adapter math against PEFT; `write_adapter` builds its
  quantized-base adapters) and tests/test_lora_e2e.py; the servers only run here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROJ_PARTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a `worker.config.ModelConfig`."""
    q, kv, c, f = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (c, q),
        "k_proj": (c, kv),
        "v_proj": (c, kv),
        "o_proj": (q, c),
        "gate_proj": (c, f),
        "up_proj": (c, f),
        "down_proj": (f, c),
    }


def write_adapter(
    directory: pathlib.Path,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    rank: int,
    seed: int,
    scale: float,
) -> pathlib.Path:
    """A PEFT-format LoRA adapter written without PEFT: `shapes` maps each targeted projection to
    its (in, out) features; every layer gets one, A ~ N(0, 0.1), B ~ N(0, scale) (0: PEFT's
    initial, do-nothing adapter); alpha = 2 x rank."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{PROJ_PARTS.get(proj, 'mlp')}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = dict(
        peft_type="LORA",
        r=rank,
        lora_alpha=2 * rank,
        target_modules=sorted(shapes),
        bias="none",
        task_type="CAUSAL_LM",
    )
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def hf_config(cfg) -> dict:
    """A transformers config.json for a `ModelConfig` (llama.cpp's converter reads the base's)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }


def convert_for_llamacpp(adapter: pathlib.Path, cfg, out: pathlib.Path) -> pathlib.Path:
    """The adapter as a llama.cpp LoRA GGUF, by llama.cpp's own convert_lora_to_gguf.py."""
    from benchmarks.llamacpp import ensure_built

    script = ensure_built().cache_dir / "src" / "convert_lora_to_gguf.py"
    base = out.parent / "base-config"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text(json.dumps(hf_config(cfg)))
    cmd = [
        sys.executable,
        str(script),
        "--base",
        str(base),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
        str(adapter),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


ADAPTER = "tuned"
SCALE = 0.02  # B's spread: the answers change (another wording) and stay text, as a fine-tune's would


def ask(
    url: str, prompt: str, adapter: bool, llamacpp: bool, max_tokens: int, timeout_s: float = 600.0
) -> dict:
    """One greedy chat completion of the base model or the adapter: its text and output tokens."""
    body: dict = {
        "model": ADAPTER if adapter and not llamacpp else "",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer max_tokens long on both sides
    }
    if llamacpp:  # loaded with --lora-init-without-apply: scale 0 unless the request sets one
        body["lora"] = [{"id": 0, "scale": 1.0 if adapter else 0.0}]
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        answer = json.loads(reply.read())
    return {
        "text": answer["choices"][0]["message"]["content"],
        "tokens": answer["usage"]["completion_tokens"],
    }


def measure(url: str, llamacpp: bool, prompts: list[str], concurrency: list[int], max_tokens: int) -> dict:
    """Per model (base / adapter) and concurrency: output tok/s over `prompts` sent closed loop;
    the greedy answers of the first pass (for the agreement)."""
    out: dict = {"tok_s": {}, "answers": {}}
    for model in ("base", "adapter"):
        ask(url, "Hello", model == "adapter", llamacpp, 4)  # unmeasured: first-request costs
        for conc in concurrency:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(conc) as pool:
                rows = list(
                    pool.map(lambda p: ask(url, p, model == "adapter", llamacpp, max_tokens), prompts)
                )
            seconds = time.perf_counter() - start
            out["tok_s"][f"{model} c{conc}"] = sum(r["tokens"] for r in rows) / seconds
            out["answers"].setdefault(model, [r["text"] for r in rows])
            print(f"  {model} c{conc}: {out['tok_s'][f'{model} c{conc}']:.1f} tok/s", flush=True)
    return out


def common_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


def markdown(res: dict) -> str:
    sides = res["sides"]
    lines = [
        f"`make bench-lora` on {res['date']}: {res['cpu']}, {res['threads']} threads each side; commit "
        f"`{res['commit']}`; adapter rank {res['rank']} on all seven projections of every layer; "
        f"{res['requests']} chat requests per point, greedy, at most {res['tokens']} tokens; medians of "
        f"{res['rounds']} rounds.",
        "",
        "| model | concurrency | ours tok/s | llama.cpp tok/s | ours / llama.cpp |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in sides.get("ours", {}).get("tok_s", {}):
        model, conc = key.split(" c")
        ours = sides["ours"]["tok_s"][key]
        theirs = sides.get("llama.cpp", {}).get("tok_s", {}).get(key)
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        lines.append(f"| {model} | {conc} | {ours:.1f} | {theirs or 0:.1f} | {ratio} |")
    for name, side in sides.items():
        cost = [side["tok_s"][f"adapter c{c}"] / side["tok_s"][f"base c{c}"] for c in res["concurrency"]]
        lines.append("")
        lines.append(
            f"{name}: adapter / base tok/s "
            + ", ".join(f"c{c} {r:.2f}" for c, r in zip(res["concurrency"], cost))
        )
    if "agreement" in res:
        a = res["agreement"]
        lines.append(
            f"Greedy answers, ours vs llama.cpp (words in common from the start, mean of {res['requests']}): "
            f"base {a['base']:.1f}, adapter {a['adapter']:.1f}."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated")
    p.add_argument("--requests", type=int, default=16, help="chat requests per point")
    p.add_argument("--tokens", type=int, default=64, help="max output tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-llamacpp", action="store_true")
    args = p.parse_args(argv)

    from benchmarks.report import REPO, git_short
    from benchmarks.serve_sides import LlamaHttpSide, OurHttpSide, run_rounds
    from benchmarks.speculative import QUESTIONS
    from benchmarks.structured_output import _cpu
    from common.model_files import default_model_path
    from worker.tp.shard import read_model_config

    model = pathlib.Path(args.model) if args.model else default_model_path()
    cfg = read_model_config(args.model)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapter = write_adapter(work / ADAPTER, cfg.num_layers, projection_shapes(cfg), args.rank, 0, SCALE)
    makers = {
        "ours": lambda: OurHttpSide(
            args.model, args.threads, work, ("--lora-modules", f"{ADAPTER}={adapter}")
        )
    }
    if not args.skip_llamacpp:
        gguf = convert_for_llamacpp(adapter, cfg, work / "adapter.gguf")
        extra = ("--lora", str(gguf), "--lora-init-without-apply")
        conc = max(concurrency)
        makers["llama.cpp"] = lambda: LlamaHttpSide(model, args.threads, conc, 1024 * conc, extra)
    res: dict = {"commands": {}, "errors": {}, "runs": {}}

    def measure_side(name: str, side, rnd: int) -> None:
        url = side.start()
        try:
            print(f"{name}, round {rnd}:", flush=True)
            res["runs"].setdefault(name, []).append(
                measure(url, name == "llama.cpp", prompts, concurrency, args.tokens)
            )
        finally:
            side.stop()

    run_rounds(makers, args.rounds, measure_side, res)
    sides = {}
    for name, runs in res["runs"].items():
        keys = runs[0]["tok_s"]
        sides[name] = {
            "tok_s": {k: statistics.median(r["tok_s"][k] for r in runs) for k in keys},
            "answers": runs[0]["answers"],
        }
    res.update(
        sides=sides,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        cpu=_cpu(),
        threads=args.threads,
        commit=git_short(),
        rank=args.rank,
        requests=args.requests,
        tokens=args.tokens,
        rounds=args.rounds,
        concurrency=concurrency,
    )
    if {"ours", "llama.cpp"} <= set(sides):
        res["agreement"] = {
            m: statistics.mean(
                common_words(a, b)
                for a, b in zip(sides["ours"]["answers"][m], sides["llama.cpp"]["answers"][m])
            )
            for m in ("base", "adapter")
        }
    table = markdown(res)
    print(table)
    out = REPO / "results" / "bench_lora"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stamp}.md").write_text(table + "\n")
    for name, errors in res["errors"].items():
        print(f"{name} errors:\n" + "\n".join(errors), file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
