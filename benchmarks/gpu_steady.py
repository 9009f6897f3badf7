"""`make bench-gpu` section for the engine hot path (issue 19): steady serving with Poisson
arrivals (FP8: benchmarks/gpu_fp8.py, which reuses this module's model and engine helpers).

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
Results go into the gpu_bench result dict (`res["steady"]`), saved after every case.
Proven by tests/test_gpu_bench.py (the smoke run, tiny sizes on CPU).
"""

from __future__ import annotations

import random
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

        def counted_run(step, size, tokens=None):  # the runner passes the feed tokens too
            replays[0] += 1
            return graph_run(step, size, tokens)

        graphs.run = counted_run
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
