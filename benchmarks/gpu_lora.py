"""`make bench-gpu` section: LoRA adapter rows against base rows on the GPU (docs/lora.md).

Protocol: the random Llama-3.2-1B-shaped model of the steady section (bf16, CUDA graphs; on CPU,
the smoke run: eager) in one engine serving one adapter written in PEFT's format: rank 16 on all
seven projections of every layer, seeded (benchmarks/lora.py `write_adapter`). For each batch size
in `lora_batches`, lockstep decode (benchmarks/gpu_steady.py `lockstep`'s timing: the same prompts
run for 1 and for N output tokens, decode step = (t_N - t_1) / (N - 1)) of three workloads:
`base` (every row the base model: the decode graph), `adapter` (every row the adapter: eager, the
wrappers add each delta) and `half` (the first half base, the rest the adapter: the base rows
replay their graph beside the adapter rows' eager launch). Reported: decode step ms, tok/s, graph
replays per decode step, and adapter / base and half / base step-time ratios.
Result: `res["lora"]`. Proven by tests/test_gpu_bench.py (the smoke run, tiny sizes on CPU).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_steady import make_engine, random_model
from benchmarks.lora import projection_shapes, write_adapter
from worker.types import SamplingParams

LORA_FULL = dict(lora_batches=[1, 16], lora_rank=16)
LORA_SMOKE = dict(lora_batches=[2], lora_rank=4)
WORKLOADS = ("base", "adapter", "half")


def _timed(engine, prompts: list[list[int]], names: list[str], n: int) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, adapter=a) for a in names]
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def lora_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    cfg_lora = LORA_SMOKE if sizes["model"].name == "random-tiny" else LORA_FULL
    p, n = sizes["prompt_len"], sizes["output_len"]
    out = res["lora"] = {"config": dict(cfg_lora, prompt_len=p, output_len=n), "rows": []}
    model = random_model(sizes, device)
    cfg = sizes["model"]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(
            Path(tmp) / "tuned", cfg.num_layers, projection_shapes(cfg), cfg_lora["lora_rank"], 0, 0.01
        )
        batches = cfg_lora["lora_batches"]
        engine = make_engine(model, device, max(batches), 1024, lora_modules=(f"tuned={adapter}",))
    out["cuda_graphs"] = engine.runner.cuda_graphs is not None
    out["adapter_mib"] = engine.runner.adapters.bytes() / 2**20
    replays = [0]
    graphs = engine.runner.cuda_graphs
    if graphs is not None:
        graph_run = graphs.run
        graphs.run = lambda *a: (replays.__setitem__(0, replays[0] + 1), graph_run(*a))[1]
    gen = torch.Generator().manual_seed(5)
    if sizes.get("warm_up", True):  # gpu_bench.SMOKE: none (CPU, Triton interpreted)
        warm = torch.randint(0, cfg.vocab_size, (2, p), generator=gen).tolist()
        _timed(engine, warm, ["", "tuned"], 4)
    for b in batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, p), generator=gen).tolist()
        row: dict = {"batch_size": b}
        for work in WORKLOADS:
            if time.perf_counter() + 30 > deadline:
                row[work] = {"skipped": "time budget"}
                continue
            names = {
                "base": [""] * b,
                "adapter": ["tuned"] * b,
                "half": [""] * (b // 2) + ["tuned"] * (b - b // 2),
            }
            t_1 = _timed(engine, prompts, names[work], 1)
            before = replays[0]
            t_n = _timed(engine, prompts, names[work], n)
            step = (t_n - t_1) / (n - 1) if t_n > t_1 and n > 1 else None
            row[work] = {
                "decode_step_ms": step * 1e3 if step else None,
                "decode_tok_s": b / step if step else None,
                "graph_replays_per_step": (replays[0] - before) / n,
            }
        steps = {w: row[w].get("decode_step_ms") for w in WORKLOADS}
        for w in ("adapter", "half"):
            if steps[w] and steps["base"]:
                row[f"{w}_over_base"] = steps[w] / steps["base"]
        out["rows"].append(row)
        print(f"  lora: {row}", flush=True)
        save()
    bm = engine.block_manager
    out["kv_blocks_leaked"] = bm.num_blocks - bm.num_free_blocks


def lora_markdown(res: dict) -> list[str]:
    s = res.get("lora")
    if not s or not s.get("rows"):
        return [] if not s else ["", f"LoRA: {s.get('error') or 'incomplete'}"]
    c = s["config"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [
        "",
        f"**LoRA** (benchmarks/gpu_lora.py: one adapter of rank {c['lora_rank']} on all seven "
        f"projections, {s['adapter_mib']:.1f} MiB; prompt {c['prompt_len']} + {c['output_len']} "
        f"output tokens, lockstep decode, {'CUDA graphs' if s['cuda_graphs'] else 'eager'}; adapter "
        "rows run eager, base rows replay their graph; KV blocks leaked: "
        f"{s.get('kv_blocks_leaked')}):",
        "",
        "| batch | base step ms (tok/s) | adapter step ms (tok/s) | half step ms (tok/s) "
        "| adapter / base | half / base | graph replays per step (base / adapter / half) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        cells = [
            f"{f(r[w].get('decode_step_ms'), '.2f')} ({f(r[w].get('decode_tok_s'), '.0f')})"
            if "skipped" not in r[w]
            else r[w]["skipped"]
            for w in WORKLOADS
        ]
        graphs = " / ".join(f(r[w].get("graph_replays_per_step"), ".2f") for w in WORKLOADS)
        lines.append(
            f"| {r['batch_size']} | {' | '.join(cells)} | {f(r.get('adapter_over_base'), '.2f')}x | "
            f"{f(r.get('half_over_base'), '.2f')}x | {graphs} |"
        )
    return lines
