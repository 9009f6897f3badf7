"""`make bench-gpu` section for FP8 on GPU (issue 19 item 5), split from benchmarks/gpu_steady.py.

Protocol:
- `fp8_section`: the same random model at batch 1 and `fp8_batch`, prompt P + N output
  tokens, engine with graphs: bf16; the per-channel form (`--fp8-group-size 0`, "fp8 ch": W8A8
  `_scaled_mm` at prefill, worker/model/fp8.py) with the activation quantization as torch ops and
  as one Triton kernel; the default `--quantization fp8` (per-128-column scales, W8A16: the
  grouped GEMV at decode, dequantize + matmul at prefill), alone and with `--kv-cache-dtype fp8`.
  Each form converts a fresh copy of the model. Decode tok/s as in the engine section, and the
  speedup over bf16. Then the real checkpoint (SmolLM2 GGUF when $SMOLLM2_GGUF / the gguf package
  are here, as for the checkpoint check, benchmarks/gpu_checkpoint.py): bf16 vs each fp8 form
  (a copy of the bf16 model each), greedy, the checkpoint prompts: relative max logit error at
  each sampled step (max |fp8 - bf16| / max |bf16| per row, then the median and max over rows of
  the first step, and over all steps), and greedy agreement (identical requests, share of tokens
  before the first divergence). The same metrics on CPU: benchmarks/fp8_accuracy.py.
Results go into the gpu_bench result dict (`res["fp8"]`), saved after every case.
Proven by tests/test_gpu_bench.py (the smoke run, tiny sizes on CPU).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from benchmarks.gpu_checkpoint import load_checkpoint
from benchmarks.gpu_steady import lockstep, make_engine, random_model, timed_generate
from worker.types import SamplingParams

FP8_VARIANTS = [
    ("bf16", {}),
    ("fp8 ch", dict(quantization="fp8", fp8_group_size=0)),  # the old form: per channel, W8A8
    ("fp8", dict(quantization="fp8")),  # the default: per 128 columns, W8A16
    ("fp8+kv", dict(quantization="fp8", kv_cache_dtype="fp8")),
]
# Speed also with the W8A8 activation quantization as plain torch ops (~6 kernels per linear
# instead of one Triton kernel: fp8.ACT_QUANT), to show what the fused quantizer buys.
SPEED_VARIANTS = [(n, e, "triton") for n, e in FP8_VARIANTS]
SPEED_VARIANTS.insert(1, ("fp8 ch torch-act", dict(quantization="fp8", fp8_group_size=0), "torch"))


def fp8_form(extra: dict) -> int | None:
    """The variant's fp8 scale group size (0 = per channel), None for bf16 weights."""
    from worker.model.fp8 import GROUP_SIZE

    return extra.get("fp8_group_size", GROUP_SIZE) if extra.get("quantization") == "fp8" else None


def fp8_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    from worker.model import fp8

    out = res["fp8"] = {"speed": [], "checkpoint": {}}
    p, n = sizes["prompt_len"], sizes["output_len"]
    batches = [1, sizes.get("fp8_batch", 64 if sizes["model"].name != "random-tiny" else 2)]
    gen = torch.Generator().manual_seed(5)
    vocab = sizes["model"].vocab_size
    prompts = {b: torch.randint(0, vocab, (b, p), generator=gen).tolist() for b in batches}
    model, form = random_model(sizes, device), None
    for name, extra, act_quant in SPEED_VARIANTS:
        if time.perf_counter() > deadline:
            out["speed"].append({"variant": name, "skipped": "time budget"})
            continue
        if fp8_form(extra) != form:  # in place, once per form; bf16 ran first
            if form is not None:
                model = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                model = random_model(sizes, device)
            form = fp8_form(extra)
            fp8.quantize_model_fp8(model, form)
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
    from worker.model.fp8 import quantize_model_fp8

    found = load_checkpoint(out, sizes, device, deadline)
    if found is None:
        return
    loaded, _, prompts = found
    num = len(prompts)
    max_tokens = sizes["ckpt_max_tokens"][1]
    out.update(model=loaded.name, requests=num, max_tokens=max_tokens)
    results = {}
    for name, extra in FP8_VARIANTS:
        if time.perf_counter() > deadline and name != "bf16":
            out[name] = {"skipped": "time budget"}
            continue
        model = loaded.model
        if fp8_form(extra) is not None:
            model = copy.deepcopy(loaded.model)  # the bf16 weights stay for the next form
            quantize_model_fp8(model, fp8_form(extra))
        engine = make_engine(model, device, num, 2048, **extra)
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
        del engine, model
    ref_tokens, ref_logits = results["bf16"]
    for name in [n for n in results if n != "bf16"]:
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
        "fp8 = the default --quantization fp8 (one scale per 128 columns, W8A16: grouped Triton GEMV "
        "at decode, dequantize + matmul at prefill); fp8 ch = --fp8-group-size 0 (per channel, W8A8 "
        "via torch._scaled_mm, activations quantized by one Triton kernel, or by torch ops in "
        "'torch-act'; the GEMV at decode where timed faster); embedding / LM head stay bf16; "
        "+kv = fp8 KV cache.",
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
    for name in ("fp8 ch", "fp8", "fp8+kv"):
        a = c.get(name)
        if a and "skipped" in a:
            lines.append(f"| {name} | {a['skipped']} | | | | |")
        elif a:
            lines.append(
                f"| {name} | {a['first_step_rel_err_median']:.3f} / {a['first_step_rel_err_max']:.3f} | "
                f"{a['rel_err_max_before_divergence']:.3f} | {a['identical']}/{c['requests']} | "
                f"{a['first_token_equal']}/{c['requests']} | {a['tokens_before_first_divergence']:.1%} |"
            )
    return lines
