"""`make bench-gpu` section: graph replay vs eager on a real checkpoint (`res["checkpoint"]`).

Protocol: the embedded SmolLM2-135M GGUF (`load_model(None | $SMOLLM2_GGUF, "bfloat16", "cuda",
quantization="none")`), greedy, requests of mixed prompt and output lengths through the engine with
CUDA graphs and with `enforce_eager`: how many requests agree token for token (random weights give
near-flat logits where bf16 rounding flips the argmax; real weights do not). The GPU machine has
neither the `gguf` package nor the model: benchmarks/gpu_session.sh can bring both (see there);
without them this section records why it was skipped. Prompts are text tokenized by the model's
tokenizer, or fixed token ids where `tokenizers` is missing. In the smoke run (CPU) both engines
run eagerly (no CUDA graphs on CPU). `load_checkpoint` is shared by every checkpoint section
(benchmarks/gpu_mixed.py, benchmarks/gpu_fp8.py).
"""

from __future__ import annotations

import os
import time

import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner
from worker.types import SamplingParams

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


def checkpoint_engine(loaded, sizes: dict, device: torch.device, max_seqs: int, batched: int, graphs: bool):
    """An engine over the loaded checkpoint (`sizes["ckpt_dtype"]`, no prefix caching), with CUDA
    graphs or eager (always eager off CUDA)."""
    cuda = device.type == "cuda"
    config = EngineConfig(
        device=str(device),
        dtype=sizes["ckpt_dtype"],
        kv_cache_bytes=256 * 2**20,
        gpu_memory_utilization=0.05,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batched,
        max_model_len=1024,
        enable_prefix_caching=False,
        attention_backend="triton" if cuda else "torch",
        enforce_eager=not (graphs and cuda),
    )
    runner = ModelRunner.from_model(config, loaded.model, loaded.eos_token_ids, loaded.name)
    return LLMEngine(config, runner=runner)


def checkpoint_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    """Graph replay vs eager, greedy, on the real SmolLM2 weights (see the module docstring)."""
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
        start = time.perf_counter()
        engine = checkpoint_engine(loaded, sizes, device, n, 2048, graphs=side == "graphs")
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
