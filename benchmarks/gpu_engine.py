"""`make bench-gpu` sections: engine vs transformers, and the HBM roofline of engine decode.

Engine vs transformers (`res["engine_setup"]`, `res["engine"]`, saved after every case): the same
random weights in our engine (CUDA graphs, then eager) and in `LlamaForCausalLM.generate` (greedy,
static batch), twice: eager with its default dynamic cache, and `cache_implementation="static"`
with the forward `torch.compile`d (inductor, mode "reduce-overhead", i.e. CUDA graphs), warmed up
at each batch size before timing. Every request in a batch has the same prompt and output length,
so transformers' static batches carry no padding (the fair, length-sorted case). Each batch size
runs every side twice: one output token (t_1, mostly prefill) and N tokens (t_N); decode tok/s =
B * (N - 1) / (t_N - t_1), end-to-end tok/s = B * N / t_N. Prefix caching is off so every run
prefills. The engine's tokens are compared with transformers' (reported, not asserted: bf16
near-ties may differ). In the smoke run transformers' compile uses the "eager" dynamo backend
(inductor on CPU would take minutes).
HBM roofline (`res["roofline"]`, from the engine section's timings, no new runs): bytes a decode
step must read (every weight once, the embedding table once via the tied LM head, plus the K/V of
each sequence's mean decode context prompt + N/2) / decode step time (t_N - t_1) / (N - 1), as a
share of the measured read bandwidth, per batch size.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback

import torch

from benchmarks.gpu_common import fmt
from worker.config import EngineConfig, ModelConfig
from worker.engine import LLMEngine
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams


def hf_llama_config(cfg: ModelConfig, **extra):
    """transformers' LlamaConfig of the same shape as `cfg` (`extra` sets or overrides fields)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_eps,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return LlamaConfig(**(fields | extra))


def build_models(cfg: ModelConfig, dtype, device) -> tuple[LlamaModel, object, str | None]:
    """Our model and transformers' on the same random weights; (ours, None, why) without HF."""
    torch.manual_seed(0)
    try:
        from transformers import LlamaForCausalLM
    except Exception as exc:  # noqa: BLE001 - transformers fails on a missing dependency
        hf, why = None, f"transformers unavailable: {type(exc).__name__}: {exc}"
    else:
        with torch.device(device):
            hf = LlamaForCausalLM(hf_llama_config(cfg))
        hf = hf.to(dtype).eval()
        hf.generation_config.eos_token_id = None
        why = None
    with torch.device(device):
        ours = LlamaModel(cfg)
    ours = ours.to(dtype).eval()
    if hf is not None:
        ours.load_hf_state_dict(hf.state_dict())
    ours.reset_rope()  # float32 tables, whatever the weights' dtype
    return ours, hf, why


def run_hf(hf, prompts: list[list[int]], output_len: int, **generate_kwargs) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=hf.device)
    start = time.perf_counter()
    with torch.no_grad():
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    tokens = gen[:, ids.shape[1] :].tolist()  # waits for the device
    return time.perf_counter() - start, tokens


def hf_compiled_run_fn(hf, sizes: dict, device: torch.device, setup: dict):
    """transformers' fast path: a static KV cache and the forward compiled by `generate` itself
    (transformers 5: `cache_implementation="static"` + `compile_config`; decode steps run the
    compiled forward, the prefill runs eagerly)."""
    from transformers import CompileConfig

    config = CompileConfig(**sizes["hf_compile"])
    if device.type != "cuda":
        config._compile_all_devices = True  # transformers compiles on CUDA only, unless told
    setup["hf_compiled_config"] = ", ".join(f"{k}={v}" for k, v in sizes["hf_compile"].items())
    return functools.partial(run_hf, hf, cache_implementation="static", compile_config=config)


def dynamo_graph_count() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter: report nothing rather than fail
        return None


def engine_run_fn(model: LlamaModel, sizes: dict, device: torch.device, enforce_eager: bool):
    config = EngineConfig(
        device=str(device),
        dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        kv_cache_bytes=64 * 2**20,
        gpu_memory_utilization=0.1,
        max_num_seqs=max(sizes["engine_batch_sizes"]),
        max_num_batched_tokens=sizes["max_num_batched_tokens"],
        max_model_len=sizes["max_model_len"],
        enable_prefix_caching=False,
        attention_backend="triton",
        enforce_eager=enforce_eager,
    )
    engine = LLMEngine(config, runner=ModelRunner.from_model(config, model, name=model.config.name))
    assert (engine.runner.cuda_graphs is None) == (enforce_eager or device.type != "cuda")

    def run(prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = engine.generate(
            prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        )
        return time.perf_counter() - start, tokens

    return run


def throughput(run, prompts: list[list[int]], output_len: int) -> tuple[dict, list[list[int]]]:
    t_1, _ = run(prompts, 1)
    t_n, tokens = run(prompts, output_len)
    b = len(prompts)
    decode_s = t_n - t_1  # noise can swamp a tiny smoke run: then no figure
    return {
        "t_1_s": t_1,
        "t_n_s": t_n,
        "e2e_tok_s": b * output_len / t_n,
        "decode_tok_s": b * (output_len - 1) / decode_s if decode_s > 0 else None,
    }, tokens


def agreement(ours: list[list[int]] | None, ref: list[list[int]] | None) -> dict:
    if ours is None or ref is None:
        return {}
    return {
        "identical": sum(a == b for a, b in zip(ours, ref)),
        "first_token_equal": sum(a[:1] == b[:1] for a, b in zip(ours, ref)),
        "requests": len(ref),
    }


def decode_weight_bytes(model: LlamaModel) -> int:
    """Weight bytes one decode step reads: every parameter once (shared ones once: a tied embedding
    is read whole by the LM head); an untied embedding table is only gathered, so it is left out."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # deduplicated by torch
    if model.lm_head is not None:
        w = model.embed_tokens.weight
        total -= w.numel() * w.element_size()
    return total


def kv_bytes_per_token(model: LlamaModel) -> int:
    """K and V bytes one token holds across the layers (in the model's dtype)."""
    cfg = model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size()


def mean_decode_context(sizes: dict) -> float:
    """Keys a decode step attends to on average: steps j = 1..N-1 read prompt_len + j."""
    return sizes["prompt_len"] + sizes["output_len"] / 2


def engine_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    cfg, batch_sizes, output_len = sizes["model"], sizes["engine_batch_sizes"], sizes["output_len"]
    model, hf, hf_missing = build_models(cfg, sizes["dtype"], device)
    setup = {k: sizes[k] for k in ("prompt_len", "output_len", "max_num_batched_tokens", "max_model_len")}
    setup["transformers"] = sys.modules["transformers"].__version__ if hf is not None else hf_missing
    setup["weight_bytes_per_step"] = decode_weight_bytes(model)
    setup["kv_bytes_per_token"] = kv_bytes_per_token(model)
    gen = torch.Generator().manual_seed(1)
    prompts = {
        b: torch.randint(0, cfg.vocab_size, (b, sizes["prompt_len"]), generator=gen).tolist()
        for b in batch_sizes + [2]
    }
    rows = {b: {"batch_size": b} for b in batch_sizes}
    res["engine_setup"], res["engine"] = setup, list(rows.values())
    sides = (["graphs"] if device.type == "cuda" else []) + ["eager"] + (["hf", "hf_compiled"] if hf else [])
    if sizes.get("skip_hf_compiled") and "hf_compiled" in sides:
        sides.remove("hf_compiled")
        setup["hf_compiled_error"] = (
            "not run: --skip-hf-compiled (this session's time went to other sections)"
        )
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for side in sides:
        run = None
        try:
            left = deadline - time.perf_counter()
            if side == "hf_compiled" and left < sizes["hf_compile_min_s"]:
                raise TimeoutError(
                    f"time budget: {left:.0f} s left, compiling needs ~{sizes['hf_compile_min_s']:.0f} s"
                )
            start = time.perf_counter()
            if side == "hf":
                run = functools.partial(run_hf, hf)
            elif side == "hf_compiled":
                run = hf_compiled_run_fn(hf, sizes, device, setup)
                graphs_before, warmup_s = dynamo_graph_count(), 0.0
            else:
                run = engine_run_fn(model, sizes, device, enforce_eager=side == "eager")
            setup[f"{side}_setup_s"] = time.perf_counter() - start
            if side != "hf_compiled" and sizes.get("warm_up", True):
                run(prompts[2], 4)  # warm-up: Triton compiles
            for b in batch_sizes:
                if time.perf_counter() > deadline:
                    rows[b][side] = {"skipped": "time budget"}
                    continue
                if side == "hf_compiled":  # compile / record this shape first
                    start = time.perf_counter()
                    run(prompts[b], output_len)
                    warmup_s += time.perf_counter() - start
                    setup["hf_compiled_warmup_s"] = warmup_s
                    print(
                        f"  {side} batch {b:4d}: compile + warm-up {time.perf_counter() - start:.1f} s",
                        flush=True,
                    )
                elif side != "hf" and sizes.get("warm_up", True):
                    # this batch's prefill shapes compile / autotune outside the timing (else t_1
                    # can exceed t_N: batch 16 read 352% of the roofline)
                    run(prompts[b], 2)
                rows[b][side], tokens[side, b] = throughput(run, prompts[b], output_len)
                print(
                    f"  {side:11s} batch {b:4d}: decode {fmt(rows[b][side]['decode_tok_s'], '10.1f')} "
                    f"tok/s, end to end {rows[b][side]['e2e_tok_s']:10.1f} tok/s",
                    flush=True,
                )
                save()
            if side == "hf_compiled":
                after = dynamo_graph_count()
                setup["hf_compiled_dynamo_graphs"] = (
                    after - graphs_before if None not in (after, graphs_before) else None
                )
        except Exception as exc:  # noqa: BLE001 - one failing side must not cost the others' numbers
            if not isinstance(exc, TimeoutError):
                traceback.print_exc()
            print(f"  {side}: {type(exc).__name__}: {exc}"[:300], flush=True)
            setup[f"{side}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        del run  # frees this engine's KV pool before the next side allocates one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    engine_side = "graphs" if device.type == "cuda" else "eager"
    for b, row in rows.items():
        # Correctness guards: the engine against transformers, graph replay against eager.
        row["agreement_vs_hf"] = agreement(tokens.get((engine_side, b)), tokens.get(("hf", b)))
        row["agreement_vs_hf_compiled"] = agreement(
            tokens.get((engine_side, b)), tokens.get(("hf_compiled", b))
        )
        row["hf_compiled_vs_hf"] = agreement(tokens.get(("hf_compiled", b)), tokens.get(("hf", b)))
        if engine_side == "graphs":
            row["graphs_vs_eager"] = agreement(tokens.get(("graphs", b)), tokens.get(("eager", b)))


def roofline_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    """% of the HBM roofline of engine decode, from the engine section's timings (no new runs)."""
    read_gbps = res.get("read", {}).get("gbps")
    setup = res.get("engine_setup")
    if not read_gbps or not setup:
        res["roofline"] = {"skipped": "needs the read bandwidth and the engine section"}
        return
    n, mean_context = sizes["output_len"], mean_decode_context(sizes)
    rows = []
    for r in res.get("engine", []):
        b = r["batch_size"]
        row = {
            "batch_size": b,
            "weight_bytes": setup["weight_bytes_per_step"],
            "kv_bytes": b * mean_context * setup["kv_bytes_per_token"],
        }
        row["bytes_per_step"] = row["weight_bytes"] + row["kv_bytes"]
        for side in ("graphs", "eager"):
            t = r.get(side, {})
            if t.get("t_n_s") is None or t.get("t_1_s") is None or t["t_n_s"] <= t["t_1_s"]:
                continue
            step_s = (t["t_n_s"] - t["t_1_s"]) / (n - 1)
            row[side] = {
                "step_ms": step_s * 1e3,
                "gbps": row["bytes_per_step"] / step_s / 1e9,
                "roofline_fraction": row["bytes_per_step"] / step_s / 1e9 / read_gbps,
                "roofline_step_ms": row["bytes_per_step"] / (read_gbps * 1e9) * 1e3,
            }
        rows.append(row)
        best = row.get("graphs") or row.get("eager")
        if best:
            print(
                f"  roofline batch {b:4d}: {row['bytes_per_step'] / 2**20:8.1f} MiB/step, step "
                f"{best['step_ms']:7.3f} ms (roofline {best['roofline_step_ms']:.3f} ms): "
                f"{best['roofline_fraction']:.0%} of read bandwidth",
                flush=True,
            )
    res["roofline"] = {"read_gbps": read_gbps, "mean_context": mean_context, "rows": rows}


def roofline_markdown(res: dict) -> list[str]:
    rf = res.get("roofline")
    if not rf:
        return []
    if "rows" not in rf:
        return ["", f"HBM roofline: {rf.get('skipped') or rf.get('error')}"]
    lines = [
        "",
        f"**Engine decode vs the HBM roofline**: bytes a decode step must read (weights "
        f"{rf['rows'][0]['weight_bytes'] / 2**20:.0f} MiB, embedding once via the tied LM head, + K/V "
        f"at the mean decode context of {rf['mean_context']:.0f} tokens) / decode step time, as a share "
        f"of the measured read bandwidth ({rf['read_gbps']:.0f} GB/s):"
        if rf["rows"]
        else "",
        "",
        "| batch | MiB read per step | roofline step ms | graphs step ms | graphs GB/s "
        "| **graphs % of roofline** | eager step ms | eager % of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rf["rows"]:
        g, e = r.get("graphs", {}), r.get("eager", {})
        roof = (g or e).get("roofline_step_ms")
        lines.append(
            f"| {r['batch_size']} | {r['bytes_per_step'] / 2**20:.1f} | {fmt(roof, '.3f')} | "
            f"{fmt(g.get('step_ms'), '.3f')} | {fmt(g.get('gbps'), '.0f')} | "
            f"{fmt(g.get('roofline_fraction'), '.0%')} | {fmt(e.get('step_ms'), '.3f')} | "
            f"{fmt(e.get('roofline_fraction'), '.0%')} |"
        )
    return lines


def engine_markdown(res: dict) -> list[str]:
    lines: list[str] = []
    if "engine" in res:
        e = res["engine_setup"]
        errors = [f"{k}: {v}" for k, v in e.items() if k.endswith("_error")]
        lines += [
            "",
            f"Engine vs transformers ({e['transformers']}), greedy, prompt {e['prompt_len']} "
            f"+ {e['output_len']} output tokens per request (every request in a batch the same "
            "lengths: transformers' static batches carry no padding), tok/s. decode = B * (N - 1) / "
            "(t_N - t_1); e2e = B * N / t_N. HF = `generate` eager (dynamic cache); HF compiled = "
            f'`generate(cache_implementation="static")`, forward `torch.compile`d '
            f"({e.get('hf_compiled_config', '-')}), warmed up at each batch size "
            f"(compile + warm-up {fmt(e.get('hf_compiled_warmup_s'), '.0f')} s in all).",
            *errors,
            "",
            "| batch | graphs decode | eager decode | HF decode | HF compiled decode | engine / HF "
            "| engine / HF compiled | graphs e2e | eager e2e | HF e2e | HF compiled e2e "
            "| identical to HF | graphs identical to eager |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["engine"]:
            g, eager, hf, hfc = (r.get(k, {}) for k in ("graphs", "eager", "hf", "hf_compiled"))
            best = g.get("decode_tok_s") or eager.get("decode_tok_s")
            ratio = best / hf["decode_tok_s"] if best and hf.get("decode_tok_s") else None
            ratio_c = best / hfc["decode_tok_s"] if best and hfc.get("decode_tok_s") else None
            agree, replay = r.get("agreement_vs_hf") or {}, r.get("graphs_vs_eager") or {}
            lines.append(
                f"| {r['batch_size']} | {fmt(g.get('decode_tok_s'), '.0f')} | "
                f"{fmt(eager.get('decode_tok_s'), '.0f')} | {fmt(hf.get('decode_tok_s'), '.0f')} | "
                f"{fmt(hfc.get('decode_tok_s'), '.0f')} | {fmt(ratio, '.2f')}x | {fmt(ratio_c, '.2f')}x | "
                f"{fmt(g.get('e2e_tok_s'), '.0f')} | {fmt(eager.get('e2e_tok_s'), '.0f')} | "
                f"{fmt(hf.get('e2e_tok_s'), '.0f')} | {fmt(hfc.get('e2e_tok_s'), '.0f')} | "
                f"{agree.get('identical', '-')}/{agree.get('requests', '-')} | "
                f"{replay.get('identical', '-')}/{replay.get('requests', '-')} |"
            )
    return lines + roofline_markdown(res)
