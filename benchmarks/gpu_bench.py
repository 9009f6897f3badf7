"""`make bench-gpu`: paged decode attention vs memory bandwidth, engine decode vs transformers.

Protocol (one GPU, no download: a randomly initialised Llama-3.2-1B-shaped model in bf16):
1. Bandwidth: READ-ONLY bandwidth (a 4 GiB float32 tensor reduced by torch `sum` and by a Triton
   kernel that loads every element once and writes one float per 128 KiB; the better of the two is
   "read bandwidth"), and a 4 GiB device-to-device `copy_` counted as bytes read + bytes written.
2. Decode attention at batch sizes 1-256 and contexts 512-32k (the model's 32 query / 8 kv heads,
   head_dim 64): our Triton paged kernel over randomly permuted 16-token blocks, and
   `F.scaled_dot_product_attention` on the same K/V laid out contiguously. Bandwidth = bytes of K
   and V read / time. Headline: the paged kernel's share of the measured READ bandwidth (attention
   only reads K/V, so that is its ceiling; the share of copy bandwidth is kept for comparison with
   older runs). Each kernel is recorded in a CUDA graph and timed with `triton.testing.do_bench`
   (median, L2 flushed before every replay), so launch overhead is excluded on both sides. The
   paged output is checked against SDPA's (max relative error).
2b. Fused RMSNorm and RoPE kernels vs the model's torch code (benchmarks/gpu_fused.py), at 1 to
   4,096 tokens: whether they pay off, as the issue asks.
2c. Real checkpoint: the embedded SmolLM2-135M GGUF (`load_model(None | $SMOLLM2_GGUF, "bfloat16",
   "cuda", quantization="none")`), greedy, requests of mixed prompt and output lengths through the
   engine with CUDA graphs and with `enforce_eager`: how many requests agree token for token (random
   weights give near-flat logits where bf16 rounding flips the argmax; real weights do not). The
   GPU machine has neither the `gguf` package nor the model: benchmarks/gpu_session.sh can bring
   both (see there); without them this part records why it was skipped.
3. Engine vs transformers: the same random weights in our engine (CUDA graphs, then eager) and in
   `LlamaForCausalLM.generate` (greedy, static batch), twice: eager with its default dynamic cache,
   and `cache_implementation="static"` with the forward `torch.compile`d (inductor,
   mode "reduce-overhead", i.e. CUDA graphs), warmed up at each batch size before timing. Every
   request in a batch has the same prompt and output length, so transformers' static batches carry
   no padding (the fair, length-sorted case). Each batch size runs every side twice: one
   output token (t_1, mostly prefill) and N tokens (t_N); decode tok/s = B * (N - 1) / (t_N - t_1),
   end-to-end tok/s = B * N / t_N. Prefix caching is off so every run prefills. The engine's
   tokens are compared with transformers' (reported, not asserted: bf16 near-ties may differ).
5. Steady serving (Poisson arrivals): benchmarks/gpu_steady.py; FP8 speed and accuracy:
   benchmarks/gpu_fp8.py; the decode step's Triton GEMV and fused sampling, alone and in the
   engine (right after the bandwidth): benchmarks/gpu_decode.py.
4. HBM roofline of engine decode: bytes a decode step must read (every weight once, the embedding
   table once via the tied LM head, plus the K/V of each sequence's mean decode context
   prompt + N/2) / decode step time (t_N - t_1) / (N - 1), as a share of the measured read
   bandwidth, per batch size.
Results go to `$OUT` (else results/) as gpu_bench.json and gpu_bench.md, rewritten after every
case so a run cut short keeps what it measured; a case or section that fails is recorded (and
printed) and the rest still runs. `--smoke` runs tiny sizes (on CPU with Triton interpreted) so CI
exercises this script; there transformers' compile uses the "eager" dynamo backend (inductor on
CPU would take minutes) and the checkpoint check runs both engines eagerly (no CUDA graphs on CPU).
`--time-budget-s` skips whatever would start too late.
Imports only torch, triton, transformers and worker modules that need nothing else (the checkpoint
check also needs `gguf`, and `tokenizers` for text prompts, falling back to fixed token ids).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_decode import decode_markdown, decode_section
from benchmarks.gpu_fp8 import fp8_markdown, fp8_section
from benchmarks.gpu_fused import fused_markdown, fused_section
from benchmarks.gpu_mixed import mixed_checkpoint_markdown, mixed_checkpoint_section
from benchmarks.gpu_steady import steady_markdown, steady_section
from benchmarks.report import git_short
from worker.config import EngineConfig, ModelConfig
from worker.engine import LLMEngine
from worker.model.llama import LlamaModel
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

LLAMA_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    max_position=131072,
    rope_theta=500000.0,
    name="random-llama-3.2-1b-shape",
)
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=512,
    name="random-tiny",
)
FULL = dict(
    model=LLAMA_1B,
    dtype=torch.bfloat16,
    copy_bytes=2**32,
    attn_batch_sizes=[1, 4, 16, 64, 256],
    contexts=[512, 2048, 8192, 32768],
    engine_batch_sizes=[1, 16, 64, 256],
    prompt_len=128,
    fused_tokens=[1, 16, 64, 256, 4096],
    output_len=128,
    max_num_batched_tokens=8192,
    max_model_len=2048,
    read_bytes=2**32,
    ckpt_dtype="bfloat16",
    ckpt_requests=16,
    ckpt_max_tokens=(24, 96),
    hf_compile=dict(mode="reduce-overhead"),
    hf_compile_min_s=150.0,
    ckpt_min_s=45.0,
    warm_up=True,
)
SMOKE = dict(
    model=TINY,
    dtype=torch.float32,
    copy_bytes=2**23,
    attn_batch_sizes=[1, 2],
    contexts=[32, 80],
    engine_batch_sizes=[1, 2],
    prompt_len=8,
    output_len=3,  # two decode steps after the first token: the fewest that time decode
    fused_tokens=[1, 8],
    max_num_batched_tokens=64,
    max_model_len=64,
    read_bytes=2**23,
    ckpt_dtype="float32",
    ckpt_requests=2,
    ckpt_max_tokens=(2, 3),
    # inductor on CPU takes minutes: the smoke run traces with dynamo and runs eagerly
    hf_compile=dict(backend="eager", mode=None),
    hf_compile_min_s=0.0,
    ckpt_min_s=0.0,
    # no untimed warm-up runs of our engine: on CPU, Triton interprets (nothing compiles, no graphs
    # to record), and each interpreted step costs a tenth of a second
    warm_up=False,
)
BLOCK_SIZE = 16
LONG_CONTEXT = 8192
TARGET_READ_FRACTION = 0.70  # of the measured read-only bandwidth, at contexts >= 8k


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
    except RuntimeError as exc:  # not capturable: time eagerly, launch overhead included
        return do_bench(fn, warmup=10, rep=50, return_mode="median"), f"eager ({exc})"[:120]
    return do_bench(graph.replay, warmup=10, rep=50, return_mode="median"), "cuda graph"


def copy_bandwidth(num_bytes: int, device: torch.device) -> dict:
    src = torch.randn(num_bytes // 4, device=device)  # float32: vectorized like K/V reads
    dst = torch.empty_like(src)
    ms, how = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": num_bytes, "ms": ms, "gbps": 2 * num_bytes / ms / 1e6, "timed_by": how}


READ_BLOCK, READ_ITERS = 4096, 8  # one Triton program reads 4096 x 8 floats = 128 KiB


@functools.cache
def _read_kernel():
    """A Triton kernel that reads every element once and writes one partial sum per program."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def read_bandwidth(num_bytes: int, device: torch.device) -> dict:
    """Read-only bandwidth: bytes read / time of a reduction over a float32 tensor (its output is
    one float, or one per 128 KiB for the Triton kernel: negligible writes). Both results are
    checked against a float64 sum; "gbps" is the better of the two kernels."""
    src = torch.rand(num_bytes // 4, device=device)
    n = src.numel()
    ref = float(src.sum(dtype=torch.float64))
    out = {"bytes": num_bytes}
    acc = torch.empty((), device=device)
    ms, how = time_ms(lambda: torch.sum(src, dim=0, out=acc), device)
    out["torch_sum"] = {
        "ms": ms,
        "gbps": num_bytes / ms / 1e6,
        "timed_by": how,
        "rel_err": abs(float(acc) - ref) / ref,
    }
    try:
        kernel = _read_kernel()
        grid = -(-n // (READ_BLOCK * READ_ITERS))
        partial = torch.empty(grid, device=device)
        ms, how = time_ms(
            lambda: kernel[(grid,)](src, partial, n, BLOCK=READ_BLOCK, ITERS=READ_ITERS), device
        )
        out["triton_read"] = {
            "ms": ms,
            "gbps": num_bytes / ms / 1e6,
            "timed_by": how,
            "rel_err": abs(float(partial.double().sum()) - ref) / ref,
        }
    except Exception as exc:  # noqa: BLE001 - torch's sum alone still gives a read bandwidth
        traceback.print_exc()
        out["triton_read"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    best = max((v for v in (out["torch_sum"], out["triton_read"]) if "gbps" in v), key=lambda v: v["gbps"])
    out["gbps"] = best["gbps"]
    out["best"] = "torch_sum" if best is out["torch_sum"] else "triton_read"
    return out


def bandwidth_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    """Read-only bandwidth (the attention and roofline denominator), then copy bandwidth."""
    try:
        res["read"] = read_bandwidth(sizes["read_bytes"], device)
        r = res["read"]
        print(
            f"read-only bandwidth: {r['gbps']:.0f} GB/s (torch sum {r['torch_sum']['gbps']:.0f}, "
            f"Triton read {fmt(r['triton_read'].get('gbps'), '.0f')})",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - the copy figure and attention still run
        traceback.print_exc()
        res["read"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save()
    try:
        res["copy"] = copy_bandwidth(sizes["copy_bytes"], device)
        print(f"device-to-device copy: {res['copy']['gbps']:.0f} GB/s (read + write)", flush=True)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res["copy"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save()


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
    scale = d**-0.5
    paged = functools.partial(
        paged_attention,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=1,
        max_seq_len=context,
        out=out,
    )
    paged_ms, paged_how = time_ms(paged, device)  # leaves the result in `out`
    kv_bytes = 2 * batch * context * hkv * d * q.element_size()
    row = {
        "batch_size": batch,
        "context_len": context,
        "kv_bytes": kv_bytes,
        "paged_us": paged_ms * 1e3,
        "paged_gbps": kv_bytes / paged_ms / 1e6,
        "timed_by": {"paged": paged_how},
    }
    del paged

    def contiguous(cache):  # (B, Hkv, L, D): one run per sequence
        return cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    try:
        # Each paged cache goes as soon as its contiguous copy exists: 256 x 32k is 8 GiB a copy.
        k = contiguous(k_cache)
        del k_cache
        v = contiguous(v_cache)
        del v_cache
        q4 = q[:, :, None, :]  # (B, H, 1, D)
        sdpa_out = torch.empty_like(q4)

        def sdpa():
            sdpa_out.copy_(F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

        sdpa_ms, row["timed_by"]["sdpa"] = time_ms(sdpa, device)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM in a fallback that repeats K/V per head,
        # or a torch without enable_gqa: the paged figures stand on their own
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    ref = sdpa_out[:, :, 0].float()
    row.update(
        sdpa_us=sdpa_ms * 1e3,
        sdpa_gbps=kv_bytes / sdpa_ms / 1e6,
        max_rel_err_vs_sdpa=float((out.float() - ref).abs().max() / ref.abs().max()),
    )
    return row


def build_models(cfg: ModelConfig, dtype, device) -> tuple[LlamaModel, object, str | None]:
    """Our model and transformers' on the same random weights; (ours, None, why) without HF."""
    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as exc:  # noqa: BLE001 - transformers fails on a missing dependency
        hf, why = None, f"transformers unavailable: {type(exc).__name__}: {exc}"
    else:
        hf_config = LlamaConfig(
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


def engine_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    cfg, batch_sizes, output_len = sizes["model"], sizes["engine_batch_sizes"], sizes["output_len"]
    model, hf, hf_missing = build_models(cfg, sizes["dtype"], device)
    setup = {k: sizes[k] for k in ("prompt_len", "output_len", "max_num_batched_tokens", "max_model_len")}
    setup["transformers"] = sys.modules["transformers"].__version__ if hf is not None else hf_missing
    setup["weight_bytes_per_step"] = decode_weight_bytes(model)
    setup["kv_bytes_per_token"] = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size()
    )
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
    n, prompt_len = sizes["output_len"], sizes["prompt_len"]
    mean_context = prompt_len + n / 2  # decode steps j = 1..N-1 attend to prompt_len + j keys
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


CKPT_SENTENCES = (
    "The harbour was quiet before dawn, and the fishing boats rocked gently at their moorings.",
    "Engineers measure the memory bandwidth of a device by streaming a large buffer through it.",
    "In the old library, a single lamp lit the long rows of leather-bound books.",
    "A good recipe lists its ingredients in the order they are used.",
    "The committee met every Tuesday to review the progress of the bridge repairs.",
    "Rivers carry sediment from the mountains to the sea over thousands of years.",
)
CKPT_QUESTIONS = (
    "why the sky is blue",
    "how a bicycle stays upright",
    "what photosynthesis does",
    "how vaccines train the immune system",
    "the rules of chess in brief",
    "why bread rises",
    "how a compass works",
    "what causes the tides",
)


def checkpoint_prompts(path, num: int, vocab: int) -> tuple[list[list[int]], str]:
    """Mixed-length text prompts tokenized by the model's own tokenizer; seeded token ids if the
    tokenizer cannot be built (the GPU machine may lack `tokenizers`)."""
    try:
        from common.model_files import default_model_path
        from common.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(path or default_model_path())
        texts = [
            " ".join(CKPT_SENTENCES[: 1 + i % len(CKPT_SENTENCES)])
            + f" Question: explain {CKPT_QUESTIONS[i % len(CKPT_QUESTIONS)]}. Answer:"
            for i in range(num)
        ]
        return [tok.encode(t) for t in texts], "text, the model's tokenizer"
    except Exception as exc:  # noqa: BLE001
        gen = torch.Generator().manual_seed(7)
        ids = [torch.randint(0, vocab, (8 + 13 * i,), generator=gen).tolist() for i in range(num)]
        return ids, f"seeded token ids ({type(exc).__name__}: {exc})"[:200]


def load_checkpoint(out: dict, sizes: dict, device: torch.device, deadline: float):
    """The real checkpoint ($SMOLLM2_GGUF, else the embedded one) in `ckpt_dtype`, unquantized, and
    its `ckpt_requests` prompts (`checkpoint_prompts`, recorded in `out["prompts"]`), as (loaded
    model, path, prompts); None, with `out["skipped"]` saying why, when --skip-checkpoint, the time
    budget or a missing file / gguf package rules it out. Shared by every checkpoint section."""
    if sizes.get("skip_checkpoint"):
        out["skipped"] = "--skip-checkpoint"
        return None
    left = deadline - time.perf_counter()
    if left < sizes["ckpt_min_s"]:
        out["skipped"] = f"time budget: {left:.0f} s left"
        return None
    path = os.environ.get("SMOLLM2_GGUF") or None
    try:
        from worker.model.loader import load_model

        loaded = load_model(path, sizes["ckpt_dtype"], device, quantization="none")
    except (ImportError, FileNotFoundError) as exc:
        out["skipped"] = (
            f"no checkpoint here ({type(exc).__name__}: {exc}); on the GPU machine "
            "benchmarks/gpu_session.sh brings the GGUF and the gguf package (see there)"
        )[:400]
        return None
    prompts, out["prompts"] = checkpoint_prompts(path, sizes["ckpt_requests"], loaded.config.vocab_size)
    return loaded, path, prompts


def checkpoint_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    """Graph replay vs eager, greedy, on the real SmolLM2 weights (see the module docstring, 2c)."""
    out = res["checkpoint"] = {"dtype": sizes["ckpt_dtype"]}
    start = time.perf_counter()
    found = load_checkpoint(out, sizes, device, deadline)
    if found is None:
        print(f"  checkpoint: {out['skipped']}", flush=True)
        return
    loaded, path, prompts = found
    out.update(model=loaded.name, load_s=time.perf_counter() - start, path=str(path or "embedded"))
    n = len(prompts)
    lo, hi = sizes["ckpt_max_tokens"]
    max_tokens = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]  # the batch shrinks as they finish
    out["prompt_lens"], out["max_tokens"] = [len(p) for p in prompts], max_tokens
    cuda = device.type == "cuda"
    if not cuda:
        out["note"] = "CPU smoke: no CUDA graphs, so both sides run eagerly (exercises the code path only)"
    tokens = {}
    for side in ("graphs", "eager"):
        config = EngineConfig(
            device=str(device),
            dtype=sizes["ckpt_dtype"],
            kv_cache_bytes=256 * 2**20,
            gpu_memory_utilization=0.05,
            max_num_seqs=n,
            max_num_batched_tokens=2048,
            max_model_len=1024,
            enable_prefix_caching=False,
            attention_backend="triton" if cuda else "torch",
            enforce_eager=side == "eager" or not cuda,
        )
        start = time.perf_counter()
        engine = LLMEngine(
            config, runner=ModelRunner.from_model(config, loaded.model, loaded.eos_token_ids, loaded.name)
        )
        out[f"{side}_uses_cuda_graphs"] = engine.runner.cuda_graphs is not None
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        tokens[side] = engine.generate(prompts, params)
        out[f"{side}_s"] = time.perf_counter() - start
        del engine
        if cuda:
            torch.cuda.empty_cache()
    g, e = tokens["graphs"], tokens["eager"]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if a == b else min(len(a), len(b)))
        for a, b in zip(g, e)
    ]
    total = sum(len(b) for b in e)
    out.update(
        requests=n,
        identical=sum(a == b for a, b in zip(g, e)),
        first_token_equal=sum(a[:1] == b[:1] for a, b in zip(g, e)),
        tokens_before_first_divergence=sum(len(b) if d is None else d for d, b in zip(first_diff, e)) / total,
        first_divergence=first_diff,
        output_tokens=total,
    )
    print(
        f"  checkpoint {loaded.name} ({sizes['ckpt_dtype']}): graphs vs eager greedy "
        f"{out['identical']}/{n} requests identical, {out['tokens_before_first_divergence']:.1%} of "
        f"tokens before the first divergence",
        flush=True,
    )


def checkpoint_markdown(res: dict) -> list[str]:
    c = res.get("checkpoint")
    if not c:
        return []
    if "identical" not in c:
        return [
            "",
            f"Real checkpoint (graphs vs eager): {c.get('skipped') or c.get('error') or 'incomplete'}",
        ]
    return [
        "",
        f"**Real checkpoint, graphs vs eager**: {c['model']} ({c['dtype']}, "
        f"{'CUDA graphs' if c.get('graphs_uses_cuda_graphs') else 'no CUDA graphs'} vs enforce_eager), "
        f"greedy, {c['requests']} requests, prompts {min(c['prompt_lens'])}-{max(c['prompt_lens'])} "
        f"tokens ({c['prompts'][:60]}), {c['max_tokens'][0]}-{c['max_tokens'][-1]} output tokens: "
        f"**{c['identical']}/{c['requests']} token-identical**, first token equal "
        f"{c['first_token_equal']}/{c['requests']}, {c['tokens_before_first_divergence']:.1%} of "
        f"{c['output_tokens']} tokens before the first divergence (first divergence per request: "
        f"{c['first_divergence']}). {c.get('note', '')}",
    ]


def attention_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    read_gbps = res.get("read", {}).get("gbps")
    copy_gbps = res.get("copy", {}).get("gbps")
    res["attention"] = []
    for batch in sizes["attn_batch_sizes"]:
        for context in sizes["contexts"]:
            row = {"batch_size": batch, "context_len": context}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
            else:
                try:
                    row = attention_case(batch, context, sizes["model"], sizes["dtype"], device)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the other cases
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res["attention"].append(row)
            if "paged_us" in row:
                if read_gbps:
                    row["read_fraction"] = row["paged_gbps"] / read_gbps
                    if "sdpa_gbps" in row:
                        row["sdpa_read_fraction"] = row["sdpa_gbps"] / read_gbps
                if copy_gbps:
                    row["copy_fraction"] = row["paged_gbps"] / copy_gbps
                print(
                    f"  attention batch {batch:4d} context {context:6d}: paged {row['paged_us']:9.1f} us "
                    f"{row['paged_gbps']:6.0f} GB/s ({fmt(row.get('read_fraction'), '4.0%')} of read, "
                    f"{fmt(row.get('copy_fraction'), '4.0%')} of copy); SDPA "
                    f"{fmt(row.get('sdpa_us'), '9.1f')} us {fmt(row.get('sdpa_gbps'), '6.0f')} GB/s; "
                    f"rel err {fmt(row.get('max_rel_err_vs_sdpa'), '.1e')}",
                    flush=True,
                )
            save()
    long_rows = [r for r in res["attention"] if r["context_len"] >= LONG_CONTEXT and "paged_us" in r]
    summary = {"long_context_cases": len(long_rows)}
    for key in ("read_fraction", "copy_fraction", "sdpa_read_fraction"):
        values = [r[key] for r in long_rows if key in r]
        if values:
            summary[f"long_context_{key}_min"], summary[f"long_context_{key}_max"] = min(values), max(values)
    reads = [r["read_fraction"] for r in long_rows if "read_fraction" in r]
    summary["long_context_target_met"] = sum(f >= TARGET_READ_FRACTION for f in reads)
    speedups = [r["sdpa_us"] / r["paged_us"] for r in long_rows if "sdpa_us" in r]
    if speedups:
        summary["long_context_sdpa_time_over_paged_min"] = min(speedups)
        summary["long_context_sdpa_time_over_paged_max"] = max(speedups)
    if long_rows:
        res["summary"] = summary


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    read, copy = res.get("read", {}), res.get("copy", {})
    lines = [f"# GPU bench: {res['device']}, {res['model']['name']}, {res['dtype']}", ""]
    if res.get("section_errors"):
        lines += [
            "Sections that failed: " + "; ".join(f"{k}: {v}" for k, v in res["section_errors"].items()),
            "",
        ]
    lines += [
        f"Read-only bandwidth: **{fmt(read.get('gbps'), '.0f')} GB/s** (bytes read / time of a "
        f"{fmt(read.get('bytes', 0) / 2**30, '.2g')} GiB float32 reduction: torch sum "
        f"{fmt(read.get('torch_sum', {}).get('gbps'), '.0f')}, Triton read kernel "
        f"{fmt(read.get('triton_read', {}).get('gbps'), '.0f')} GB/s"
        f"{'; ' + read['error'] if 'error' in read else ''}). Device-to-device copy: "
        f"{fmt(copy.get('gbps'), '.0f')} GB/s (read + write). Decode attention, one query token per "
        f"sequence, {res['model']['num_heads']} query / {res['model']['num_kv_heads']} kv heads, "
        f"head_dim {res['model']['head_dim']}; GB/s = K/V bytes read / time:",
        "",
        "| batch | context | K/V MiB | paged us | paged GB/s | % of read BW | % of copy | SDPA us "
        "| SDPA GB/s | SDPA % of read | SDPA time / paged time | max rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.get("attention", []):
        if "paged_us" not in r:
            lines.append(
                f"| {r['batch_size']} | {r['context_len']} | "
                f"{r.get('error') or r.get('skipped')} | | | | | | | | | |"
            )
            continue
        speedup = r["sdpa_us"] / r["paged_us"] if "sdpa_us" in r else None
        lines.append(
            f"| {r['batch_size']} | {r['context_len']} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r['paged_us']:.1f} | {r['paged_gbps']:.0f} | {fmt(r.get('read_fraction'), '.0%')} | "
            f"{fmt(r.get('copy_fraction'), '.0%')} | {fmt(r.get('sdpa_us'), '.1f')} | "
            f"{fmt(r.get('sdpa_gbps'), '.0f')} | {fmt(r.get('sdpa_read_fraction'), '.0%')} | "
            f"{fmt(speedup, '.2f')}x | "
            f"{r.get('sdpa_error', fmt(r.get('max_rel_err_vs_sdpa'), '.1e'))[:80]} |"
        )
    s = res.get("summary")
    if s and "long_context_read_fraction_min" in s:
        lines += [
            "",
            f"**Long contexts (>= {LONG_CONTEXT}): paged attention reaches "
            f"{s['long_context_read_fraction_min']:.0%}-{s['long_context_read_fraction_max']:.0%} "
            f"of the measured read bandwidth** (target >= {TARGET_READ_FRACTION:.0%}: met in "
            f"{s['long_context_target_met']}/{s['long_context_cases']} cases); SDPA on contiguous K/V "
            f"{fmt(s.get('long_context_sdpa_read_fraction_min'), '.0%')}-"
            f"{fmt(s.get('long_context_sdpa_read_fraction_max'), '.0%')}; SDPA time / paged time "
            f"{fmt(s.get('long_context_sdpa_time_over_paged_min'), '.2f')}-"
            f"{fmt(s.get('long_context_sdpa_time_over_paged_max'), '.2f')}x.",
        ]
    lines += fused_markdown(res)
    lines += checkpoint_markdown(res)
    lines += mixed_checkpoint_markdown(res)
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
    lines += roofline_markdown(res)
    lines += steady_markdown(res)
    lines += fp8_markdown(res)
    lines += decode_markdown(res)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU (Triton interpreted)")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=420.0,
        help="skip the cases that would start after this many seconds",
    )
    p.add_argument("--skip-engine", action="store_true", help="bandwidth, attention and fused kernels only")
    p.add_argument("--skip-checkpoint", action="store_true", help="no real-checkpoint graphs vs eager check")
    p.add_argument("--skip-hf-compiled", action="store_true", help="no transformers static cache + compile")
    p.add_argument("--skip-hot-path", action="store_true", help="no steady-serving and FP8 sections")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "results")
    args = p.parse_args()
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("gpu_bench needs a CUDA device (--smoke runs tiny sizes on CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, when triton is imported
    import triton

    sizes = dict(
        SMOKE if args.smoke else FULL,
        skip_hf_compiled=args.skip_hf_compiled,
        skip_checkpoint=args.skip_checkpoint,
    )
    device = torch.device("cuda" if cuda else "cpu")
    res = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "smoke": args.smoke,
        "git": git_short(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "model": dataclasses.asdict(sizes["model"]),
        "dtype": str(sizes["dtype"]).removeprefix("torch."),
        "args": vars(args),
    }
    out_dir, stem = Path(args.out_dir), "gpu_bench_smoke" if args.smoke else "gpu_bench"

    def save() -> None:  # after every case: a run cut short keeps what it measured
        res["elapsed_s"] = time.perf_counter() - t0
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2, default=str))
        try:
            table = markdown(res)
        except Exception as exc:  # noqa: BLE001 - a table bug must not cost the measurements
            traceback.print_exc()
            table = f"markdown failed: {type(exc).__name__}: {exc}; see {stem}.json\n"
        (out_dir / f"{stem}.md").write_text(table)

    print(
        f"{res['device']}: torch {torch.__version__}, triton {triton.__version__}, git {res['git']}",
        flush=True,
    )
    deadline = t0 + args.time_budget_s
    # The hot-path sections first (what no GPU session has measured yet), so a session's deadline
    # cuts the sections measured before: bandwidth (their denominator), the decode-step kernels
    # (benchmarks/gpu_decode.py), steady serving with async scheduling (benchmarks/gpu_steady.py),
    # FP8 (benchmarks/gpu_fp8.py), then the rest.
    sections = [("bandwidth", bandwidth_section)]
    hot = not args.skip_hot_path
    if hot:
        sections.append(("decode", decode_section))
        if not args.skip_engine:
            sections += [("steady", steady_section), ("fp8", fp8_section)]
    sections += [
        ("fused", lambda *a: fused_section(*a, time_ms)),
        ("attention", attention_section),
    ]
    if not args.skip_checkpoint:
        sections.append(("checkpoint", checkpoint_section))
        if hot:
            sections.append(("mixed_checkpoint", mixed_checkpoint_section))  # benchmarks/gpu_mixed.py
    if not args.skip_engine:
        sections += [("engine", engine_section), ("roofline", roofline_section)]
    for name, section in sections:
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
            section(res, sizes, device, deadline, save)
        except Exception as exc:  # noqa: BLE001 - one failing section must not cost the others
            traceback.print_exc()
            res.setdefault("section_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"section {name} failed: {res['section_errors'][name]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    print("\n" + open(out_dir / f"{stem}.md").read())
    print(f"wrote {out_dir / stem}.json and .md in {res['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
