"""`make bench-gpu` section: graphs vs eager on the real checkpoint with staggered arrivals, so most
steps are mixed (prompt chunks in one eager launch next to the decode graph, issue 19).

Protocol: the SmolLM2 GGUF as in the checkpoint check (benchmarks/gpu_checkpoint.py:
`$SMOLLM2_GGUF`, the gguf package; skipped with the reason when absent), bf16 on CUDA. The same
requests (the checkpoint prompts, greedy, `ckpt_max_tokens[1]` tokens each, ignore_eos) reach two
engines, one with CUDA graphs and one with `enforce_eager`, by the same schedule: one new request
per engine step, with a token budget of 64 per step so long prompts take several chunks. Reported:
the share of steps that mixed prompt chunks with decode rows and the share that replayed a graph
(graphs side), and how many requests are token-identical between the two sides (bf16 near-ties may
differ, as in the checkpoint check).
Result: `res["mixed_checkpoint"]`. Proven by tests/test_gpu_bench.py (smoke: the skip path).
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_checkpoint import checkpoint_engine, load_checkpoint
from worker.engine import LLMEngine
from worker.types import SamplingParams


def staggered(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    counts = {"steps": 0, "mixed": 0, "graph": 0}
    schedule = engine.scheduler.schedule

    def counting():
        plan = schedule()
        decode = sum(s.num_new_tokens == 1 for s in plan.scheduled)
        counts["steps"] += bool(plan.scheduled)
        counts["mixed"] += 0 < decode < len(plan.scheduled)
        return plan

    engine.scheduler.schedule = counting
    graphs = engine.runner.cuda_graphs
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda step, size: (counts.__setitem__("graph", counts["graph"] + 1), run(step, size))[1]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"m{i}", prompt, sp)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out.get(f"m{i}", []) for i in range(len(prompts))], counts


def mixed_checkpoint_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    out = res["mixed_checkpoint"] = {}
    found = load_checkpoint(out, sizes, device, deadline)
    if found is None:
        return
    loaded, _, prompts = found
    n = len(prompts)
    max_tokens = sizes["ckpt_max_tokens"][1]
    tokens = {}
    for side in ("graphs", "eager"):
        engine = checkpoint_engine(loaded, sizes, device, n, 64, graphs=side == "graphs")
        start = time.perf_counter()
        tokens[side], counts = staggered(engine, prompts, max_tokens)
        out[side] = dict(
            counts, seconds=time.perf_counter() - start, graphs=engine.runner.cuda_graphs is not None
        )
        bm = engine.block_manager
        out[side]["kv_blocks_leaked"] = bm.num_blocks - bm.num_free_blocks
        del engine
        save()
    g, e = tokens["graphs"], tokens["eager"]
    out.update(
        model=loaded.name,
        requests=n,
        max_tokens=max_tokens,
        identical=sum(a == b for a, b in zip(g, e)),
        first_token_equal=sum(a[:1] == b[:1] for a, b in zip(g, e)),
    )
    print(f"  mixed-step checkpoint: {out}", flush=True)


def mixed_checkpoint_markdown(res: dict) -> list[str]:
    m = res.get("mixed_checkpoint")
    if not m:
        return []
    if "identical" not in m:
        return ["", f"Real checkpoint, mixed steps (graphs vs eager): {m.get('skipped') or 'incomplete'}"]
    g = m["graphs"]
    steps = max(g["steps"], 1)
    return [
        "",
        f"**Real checkpoint, staggered arrivals (mixed steps), graphs vs eager**: {m['model']}, greedy, "
        f"{m['requests']} requests x {m['max_tokens']} tokens, one arrival per step, 64-token budget: "
        f"**{m['identical']}/{m['requests']} token-identical**, first token equal "
        f"{m['first_token_equal']}/{m['requests']}; graphs side: {g['mixed'] / steps:.0%} of "
        f"{g['steps']} steps mixed, {g['graph'] / steps:.0%} replayed a graph"
        f"{'' if g['graphs'] else ' (no CUDA graphs here)'}; KV blocks leaked: "
        f"{g['kv_blocks_leaked']} / {m['eager']['kv_blocks_leaked']}.",
    ]
