"""`make bench-gpu` sections for the engine hot path (issue 19): steady serving with Poisson
arrivals, and FP8 (speed on the random 1B shape, accuracy on the real checkpoint).

Protocol:
- Steady serving (`steady_section`): the random Llama-3.2-1B-shaped model (bf16) in one engine
  with CUDA graphs (on CPU, the smoke run: eager), chunked prefill sharing the token budget with
  decodes, prefix caching off. First lockstep: `steady_max_seqs` requests submitted together
  (prompt P, output N), timed for 1 and for N output tokens: decode step time = (t_N - t_1) /
  (N - 1), saturation rate = requests / t_N (req/s, prefill included). Then, for each fraction f in
  `steady_fractions`, requests arrive open-loop as a seeded Poisson process at f x saturation
  (rate x `steady_duration_s` of them, at least 2; the loop adds the requests that have arrived,
  steps the engine, and when nothing runs waits on the clock for the next arrival: the load
  generator's timer, nothing waits on the engine). Per rate: output tok/s over the run,
  inter-token latency (ITL, the time between a request's consecutive tokens) p50/p90/p99, TTFT
  p50/p99, the mean number of running requests, the share of steps that mixed prompt chunks with
  decodes and the share that replayed a graph, and ITL p50 / lockstep decode step time (1.0 = as
  fast per token as lockstep decode). Then the highest fraction once more, same seed and
  arrivals, on an engine with async scheduling (`async_row`), with its overlapped / synchronous
  step counts.
- FP8 (`fp8_section`): the same random model at batch 1 and `fp8_batch`, prompt P + N output
  tokens, engine with graphs: bf16; `--quantization fp8` (W8A8 linears, worker/model/fp8.py) with
  the activation quantization as torch ops and as one Triton kernel; fp8 weights +
  `--kv-cache-dtype fp8`. Decode tok/s as in the engine section, and the speedup over
  bf16. Then the real checkpoint (SmolLM2 GGUF when $SMOLLM2_GGUF / the gguf package are here, as
  for gpu_bench's checkpoint check): bf16 vs fp8 weights vs fp8 weights + fp8 KV, greedy, the
  checkpoint prompts: relative max logit error at each sampled step (max |fp8 - bf16| / max |bf16|
  per row, then the median and max over rows of the first step, and over all steps), and greedy
  agreement (identical requests, share of tokens before the first divergence).
Results go into the gpu_bench result dict (`res["steady"]`, `res["fp8"]`), saved after every case.
Proven by tests/test_gpu_bench.py (the smoke run, tiny sizes on CPU).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

STEADY_FULL = dict(
    steady_max_seqs=64, steady_batched_tokens=1024, steady_fractions=[0.5, 0.8], steady_duration_s=8.0
)
STEADY_SMOKE = dict(
    steady_max_seqs=3, steady_batched_tokens=32, steady_fractions=[0.8], steady_duration_s=1.0
)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def random_model(sizes: dict, device: torch.device) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(sizes["model"])
    model = model.to(sizes["dtype"]).eval()
    model.reset_rope()  # float32 tables, whatever the weights' dtype
    return model


def make_engine(model: LlamaModel, device: torch.device, max_seqs: int, batched: int, **extra) -> LLMEngine:
    config = EngineConfig(
        device=str(device),
        dtype=str(model.norm.weight.dtype).removeprefix("torch."),
        kv_cache_bytes=64 * 2**20,
        gpu_memory_utilization=0.15,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batched,
        max_model_len=1024,
        enable_prefix_caching=False,
        attention_backend="triton",
        **extra,
    )
    return LLMEngine(config, runner=ModelRunner.from_model(config, model, name=model.config.name))


def timed_generate(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start, tokens


def lockstep(engine: LLMEngine, prompts: list[list[int]], n: int) -> dict:
    t_1, _ = timed_generate(engine, prompts, 1)
    t_n, _ = timed_generate(engine, prompts, n)
    step = (t_n - t_1) / (n - 1) if t_n > t_1 and n > 1 else None
    return dict(
        batch_size=len(prompts),
        t_1_s=t_1,
        t_n_s=t_n,
        decode_step_ms=step * 1e3 if step else None,
        decode_tok_s=len(prompts) / step if step else None,
        saturation_req_s=len(prompts) / t_n,
    )


def poisson_run(
    engine: LLMEngine, rate: float, duration_s: float, prompt_len: int, n: int, seed: int
) -> dict:
    rng = random.Random(seed)
    vocab = engine.info.vocab_size
    arrivals, t = [], 0.0
    for _ in range(max(2, round(rate * duration_s))):  # the expected count over the duration
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in arrivals]
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    plans = {"steps": 0, "mixed": 0, "running": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule(*args, **kwargs):  # async scheduling plans with speculative=True
        plan = schedule(*args, **kwargs)
        if plan.scheduled:
            decode = sum(s.num_new_tokens == 1 for s in plan.scheduled)
            plans["steps"] += 1
            plans["mixed"] += 0 < decode < len(plan.scheduled)
            plans["running"] += len(plan.scheduled)
        return plan

    replays = [0]
    graphs = engine.runner.cuda_graphs
    if graphs is not None:
        graph_run = graphs.run
        graphs.run = lambda step, size: (replays.__setitem__(0, replays[0] + 1), graph_run(step, size))[1]
    engine.scheduler.schedule = counting_schedule
    last: dict[str, float] = {}
    itl, ttft, out_tokens = [], [], 0
    t0 = time.perf_counter()
    i = 0
    try:
        while i < len(arrivals) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while i < len(arrivals) and arrivals[i] <= now:
                engine.add_request(f"p{seed}-{i}", prompts[i], sp)
                last[f"p{seed}-{i}"] = -arrivals[i]  # negative: no token yet (arrival time)
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[i] - now))  # open-loop arrivals: the next one's time
                continue
            outs = engine.step()
            now = time.perf_counter() - t0
            for o in outs:
                if not o.new_token_ids:
                    continue
                prev = last[o.request_id]
                (ttft if prev < 0 else itl).append(now + prev if prev < 0 else now - prev)
                last[o.request_id] = now
                out_tokens += len(o.new_token_ids)
    finally:
        engine.scheduler.schedule = schedule
        if graphs is not None:
            graphs.run = graph_run
    elapsed = time.perf_counter() - t0
    steps = max(plans["steps"], 1)
    return dict(
        rate_req_s=rate,
        requests=len(arrivals),
        elapsed_s=elapsed,
        output_tok_s=out_tokens / elapsed,
        itl_p50_ms=_ms(pct(itl, 50)),
        itl_p90_ms=_ms(pct(itl, 90)),
        itl_p99_ms=_ms(pct(itl, 99)),
        ttft_p50_ms=_ms(pct(ttft, 50)),
        ttft_p99_ms=_ms(pct(ttft, 99)),
        mean_running=plans["running"] / steps,
        mixed_step_share=plans["mixed"] / steps,
        graph_step_share=replays[0] / steps,
        steps=plans["steps"],
    )


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def steady_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    st = STEADY_FULL if sizes["model"].name != "random-tiny" else STEADY_SMOKE
    out = res["steady"] = {"config": dict(st, prompt_len=sizes["prompt_len"], output_len=sizes["output_len"])}
    p, n = sizes["prompt_len"], sizes["output_len"]
    model = random_model(sizes, device)
    engine = make_engine(model, device, st["steady_max_seqs"], st["steady_batched_tokens"])
    out["cuda_graphs"] = engine.runner.cuda_graphs is not None
    gen = torch.Generator().manual_seed(3)
    vocab = sizes["model"].vocab_size
    warm_up = torch.randint(0, vocab, (2, p), generator=gen).tolist()
    if sizes.get("warm_up", True):  # gpu_bench.SMOKE: none (CPU, Triton interpreted)
        timed_generate(engine, warm_up, 4)
    prompts = torch.randint(0, vocab, (st["steady_max_seqs"], p), generator=gen).tolist()
    lock = out["lockstep"] = lockstep(engine, prompts, n)
    print(f"  steady: lockstep {lock}", flush=True)
    save()
    out["rates"] = []
    for k, frac in enumerate(st["steady_fractions"]):
        if time.perf_counter() + st["steady_duration_s"] * 2 > deadline:
            out["rates"].append({"fraction": frac, "skipped": "time budget"})
            continue
        row = poisson_run(engine, frac * lock["saturation_req_s"], st["steady_duration_s"], p, n, seed=k)
        row["fraction"] = frac
        if row["itl_p50_ms"] and lock["decode_step_ms"]:
            row["itl_p50_over_lockstep_step"] = row["itl_p50_ms"] / lock["decode_step_ms"]
        out["rates"].append(row)
        print(f"  steady {frac:.0%} of saturation: {row}", flush=True)
        save()
    bm = engine.block_manager
    out["kv_blocks_leaked"] = bm.num_blocks - bm.num_free_blocks
    async_row(out, model, device, st, lock, p, n, deadline)
    save()


def async_row(out: dict, model, device: torch.device, st: dict, lock: dict, p: int, n: int, deadline):
    """The highest load again, same seed and arrivals, on an engine with async scheduling
    (--async-scheduling: step N+1 planned while step N runs): ITL and throughput beside the
    synchronous row above, and its overlapped / synchronous step counts."""
    k, frac = len(st["steady_fractions"]) - 1, st["steady_fractions"][-1]
    if time.perf_counter() + st["steady_duration_s"] * 2 > deadline:
        out["async"] = {"fraction": frac, "skipped": "time budget"}
        return
    engine = make_engine(
        model, device, st["steady_max_seqs"], st["steady_batched_tokens"], async_scheduling=True
    )
    try:
        row = poisson_run(engine, frac * lock["saturation_req_s"], st["steady_duration_s"], p, n, seed=k)
    finally:
        engine.close()  # its executor thread
    stats = engine.stats()
    row.update(fraction=frac, overlapped_steps=stats.num_overlapped_steps, sync_steps=stats.num_sync_steps)
    if row["itl_p50_ms"] and lock["decode_step_ms"]:
        row["itl_p50_over_lockstep_step"] = row["itl_p50_ms"] / lock["decode_step_ms"]
    bm = engine.block_manager
    row["kv_blocks_leaked"] = bm.num_blocks - bm.num_free_blocks
    out["async"] = row
    print(f"  steady {frac:.0%} of saturation, async scheduling: {row}", flush=True)


def steady_markdown(res: dict) -> list[str]:
    s = res.get("steady")
    if not s or "lockstep" not in s:
        return [] if not s else ["", f"Steady serving: {s.get('error') or 'incomplete'}"]
    c, lock = s["config"], s["lockstep"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    mode = "CUDA graphs: decode graph + one eager prompt-chunk launch per mixed step"
    mode = mode if s["cuda_graphs"] else "eager"
    lines = [
        "",
        f"**Steady serving** (Poisson arrivals, prompt {c['prompt_len']} + {c['output_len']} output "
        f"tokens, max {c['steady_max_seqs']} running, token budget {c['steady_batched_tokens']} per "
        f"step, {mode}, synchronous engine; the async row: async scheduling): lockstep "
        f"{lock['batch_size']} requests: decode step "
        f"{f(lock['decode_step_ms'], '.2f')} ms ({f(lock['decode_tok_s'], '.0f')} tok/s), saturation "
        f"{lock['saturation_req_s']:.1f} req/s. KV blocks leaked after the runs: "
        f"{s.get('kv_blocks_leaked')}.",
        "",
        "| load | req/s | requests | output tok/s | ITL p50 / p90 / p99 ms | TTFT p50 / p99 ms "
        "| mean running | mixed steps | graph steps | ITL p50 / lockstep step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(r, "") for r in s.get("rates", [])]
    rows += [(s["async"], " async")] if "async" in s else []
    for r, label in rows:
        if "skipped" in r:
            lines.append(f"| {r['fraction']:.0%}{label} | {r['skipped']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['fraction']:.0%}{label} | {r['rate_req_s']:.1f} | {r['requests']} | "
            f"{r['output_tok_s']:.0f} | "
            f"{f(r['itl_p50_ms'], '.2f')} / {f(r['itl_p90_ms'], '.2f')} / {f(r['itl_p99_ms'], '.2f')} | "
            f"{f(r['ttft_p50_ms'], '.1f')} / {f(r['ttft_p99_ms'], '.1f')} | {r['mean_running']:.1f} | "
            f"{r['mixed_step_share']:.0%} | {r['graph_step_share']:.0%} | "
            f"{f(r.get('itl_p50_over_lockstep_step'), '.2f')}x |"
        )
    return lines


# -- FP8 ---------------------------------------------------------------------------------------
FP8_VARIANTS = [
    ("bf16", {}),
    ("fp8", dict(quantization="fp8")),
    ("fp8+kv", dict(quantization="fp8", kv_cache_dtype="fp8")),
]
# Speed also with the activation quantization as plain torch ops (~6 kernels per linear instead of
# one Triton kernel: fp8.ACT_QUANT), to show what the fused quantizer buys.
SPEED_VARIANTS = [(n, e, "triton") for n, e in FP8_VARIANTS]
SPEED_VARIANTS.insert(1, ("fp8 torch-act", dict(quantization="fp8"), "torch"))


def fp8_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    from worker.model import fp8

    out = res["fp8"] = {"speed": [], "checkpoint": {}}
    p, n = sizes["prompt_len"], sizes["output_len"]
    batches = [1, sizes.get("fp8_batch", 64 if sizes["model"].name != "random-tiny" else 2)]
    gen = torch.Generator().manual_seed(5)
    vocab = sizes["model"].vocab_size
    prompts = {b: torch.randint(0, vocab, (b, p), generator=gen).tolist() for b in batches}
    model = random_model(sizes, device)
    for name, extra, act_quant in SPEED_VARIANTS:
        if time.perf_counter() > deadline:
            out["speed"].append({"variant": name, "skipped": "time budget"})
            continue
        if extra.get("quantization") == "fp8":
            fp8.quantize_model_fp8(model)  # in place, once; bf16 ran first
        fp8.ACT_QUANT = act_quant  # read at each forward: the graphs record this path
        try:
            engine = make_engine(model, device, max(batches), 2048, **extra)
            if sizes.get("warm_up", True):
                timed_generate(engine, prompts[1], 4)
            for b in batches:
                row = dict(variant=name, **lockstep(engine, prompts[b], n))
                out["speed"].append(row)
                print(f"  fp8 speed {name} batch {b}: decode {row['decode_tok_s']} tok/s", flush=True)
                save()
        except Exception as exc:  # noqa: BLE001 - one variant failing must not cost the others
            out["speed"].append({"variant": name, "skipped": f"{type(exc).__name__}: {exc}"[:200]})
        finally:
            fp8.ACT_QUANT = "triton"
        engine = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["batch_size"]: r.get("decode_tok_s") for r in out["speed"] if r["variant"] == "bf16"}
    for r in out["speed"]:
        if r.get("decode_tok_s") and base.get(r.get("batch_size")):
            r["speedup_vs_bf16"] = r["decode_tok_s"] / base[r["batch_size"]]
    del model
    fp8_checkpoint(out["checkpoint"], sizes, device, deadline)


def fp8_checkpoint(out: dict, sizes: dict, device: torch.device, deadline: float) -> None:
    from benchmarks.gpu_bench import checkpoint_prompts, load_checkpoint
    from worker.model.fp8 import quantize_model_fp8

    found = load_checkpoint(out, sizes, device, deadline)
    if found is None:
        return
    loaded, path = found
    num = sizes["ckpt_requests"]
    prompts, out["prompts"] = checkpoint_prompts(path, num, loaded.config.vocab_size)
    max_tokens = sizes["ckpt_max_tokens"][1]
    out.update(model=loaded.name, requests=num, max_tokens=max_tokens)
    results = {}
    for name, extra in FP8_VARIANTS:
        if name != "bf16":
            quantize_model_fp8(loaded.model)
        engine = make_engine(loaded.model, device, num, 2048, **extra)
        logits: dict[str, list[torch.Tensor]] = {}
        engine.runner.logits_observer = lambda ids, rows: [
            logits.setdefault(i, []).append(r.float().cpu()) for i, r in zip(ids, rows)
        ]
        ids = [f"c{i}" for i in range(num)]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(
                rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
        toks: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.request_id].extend(o.new_token_ids)
        results[name] = ([toks[r] for r in ids], [logits[r] for r in ids])
        del engine
    ref_tokens, ref_logits = results["bf16"]
    for name in ("fp8", "fp8+kv"):
        tokens, logits = results[name]
        first = [float((a[0] - b[0]).abs().max() / b[0].abs().max()) for a, b in zip(logits, ref_logits)]
        # Later steps compare only while both saw the same tokens (before the first divergence).
        div = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            for a, b in zip(tokens, ref_tokens)
        ]
        every = [
            float((a[j] - b[j]).abs().max() / b[j].abs().max())
            for a, b, d in zip(logits, ref_logits, div)
            for j in range(min(d + 1, len(a), len(b)))
        ]
        out[name] = dict(
            first_step_rel_err_median=statistics.median(first),
            first_step_rel_err_max=max(first),
            rel_err_max_before_divergence=max(every),
            identical=sum(a == b for a, b in zip(tokens, ref_tokens)),
            first_token_equal=sum(a[:1] == b[:1] for a, b in zip(tokens, ref_tokens)),
            tokens_before_first_divergence=sum(div) / sum(len(b) for b in ref_tokens),
        )
        print(f"  fp8 checkpoint {name}: {out[name]}", flush=True)


def fp8_markdown(res: dict) -> list[str]:
    r = res.get("fp8")
    if not r:
        return []
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [
        "",
        "**FP8** (random 1B shape, prompt + output as the engine section, CUDA graphs): decode tok/s; "
        "fp8 = W8A8 linears via torch._scaled_mm (embedding / LM head stay bf16; activations quantized "
        "by one Triton kernel, or by torch ops in 'fp8 torch-act'), +kv = fp8 KV cache.",
        "",
        "| variant | batch | decode step ms | decode tok/s | speedup vs bf16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r.get("speed", []):
        if "skipped" in s:
            lines.append(f"| {s['variant']} | {s['skipped']} | | | |")
            continue
        lines.append(
            f"| {s['variant']} | {s['batch_size']} | {f(s['decode_step_ms'], '.3f')} | "
            f"{f(s['decode_tok_s'], '.0f')} | {f(s.get('speedup_vs_bf16'), '.2f')}x |"
        )
    c = r.get("checkpoint", {})
    if "fp8" not in c:
        lines += [
            "",
            f"FP8 accuracy on the real checkpoint: {c.get('skipped') or c.get('error') or 'not run'}",
        ]
        return lines
    lines += [
        "",
        f"**FP8 accuracy vs bf16 on {c['model']}** (greedy, {c['requests']} requests x {c['max_tokens']} "
        f"tokens, {c['prompts'][:40]}): relative logit error = max |fp8 - bf16| / max |bf16| per step.",
        "",
        "| variant | first-step error median / max | max error before divergence | identical requests "
        "| first token equal | tokens before first divergence |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("fp8", "fp8+kv"):
        a = c.get(name)
        if a:
            lines.append(
                f"| {name} | {a['first_step_rel_err_median']:.3f} / {a['first_step_rel_err_max']:.3f} | "
                f"{a['rel_err_max_before_divergence']:.3f} | {a['identical']}/{c['requests']} | "
                f"{a['first_token_equal']}/{c['requests']} | {a['tokens_before_first_divergence']:.1%} |"
            )
    return lines
