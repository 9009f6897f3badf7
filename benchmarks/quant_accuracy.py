"""Accuracy, memory and load time of the quantized embedded SmolLM2 vs its float32 reference.

Contract: `python -m benchmarks.quant_accuracy [--json PATH] [--prompts N] [--tokens N]`
(`make quant-accuracy`). Prints a markdown report and writes it as JSON when asked:
- greedy generation, free-running, 20 chat prompts x 64 new tokens (eos ignored), of the float32
  reference (`quantization="none"`, dtype float32: token-identical to transformers, see
  tests/test_engine_hf.py) and of each candidate: the default CPU path (dtype bfloat16,
  quantization "auto": Q4_1 linears as int4, the Q8_0 embedding as int8 rows) on torch's
  weight-only kernels, the same weights as a CPU worker serves them (`apply_cpu_paths` with the
  default EngineConfig: int8 activations on AVX512-VNNI / AVX2 CPUs, dequantize-then-GEMM for many rows)
  and dense bfloat16 (`quantization="none"`), which separates the bfloat16-activation error from
  the quantization's.
  Per prompt: the first position where the tokens differ (64 = never).
- teacher-forced, on the reference's own sequences: each candidate's logits vs the reference's at
  every generated position (max and mean absolute error, and max over max |logit|) and the top-1
  agreement %, which a single early divergence cannot cascade into.
- per form, one fresh process each: load time, resident memory of the weights (RSS after the load
  minus RSS before it, both after the same imports and warm-up, freed heap returned) and the peak
  during the load (VmHWM minus the RSS before), against the GGUF file's size.
Everything runs with the "torch" attention backend on `--threads` threads (default 2).
`--kernels 1,4,16,...` instead times the weight forms on SmolLM2's layer shapes (random weights):
ms for all 120 linear layers once per row count, plus the lm_head (benchmarks/quant_kernels.py).
Proven by running it: docs/quantization.md holds a run's output; tests/test_quant_smollm.py checks the
same quantities at smaller size with margins taken from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why 1 is not prime.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between Python and C?",
    "Write a short story about a robot who learns to paint.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How does a binary search work? Give an example.",
    "What causes the seasons on Earth?",
    "Translate to French: The weather is nice today.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Suggest five names for a coffee shop.",
    "What is the difference between weather and climate?",
    "Describe the water cycle step by step.",
    "Write a polite email declining a meeting invitation.",
    "What is 17 times 23? Show your work.",
    "Give three tips for learning a new language.",
    "Explain what a neural network is in simple terms.",
]

FORMS = {  # label -> (dtype, quantization, the served CPU paths applied)
    "reference float32": ("float32", "none", False),
    "auto (int4 + int8 embedding)": ("bfloat16", "auto", False),
    "auto as served (int8 activations: VNNI or AVX2)": ("bfloat16", "auto", True),
    "dense bfloat16": ("bfloat16", "none", False),
}


def _metadata(lens: list[int], new: list[int], block_size: int, tables: list[list[int]]):
    """AttentionMetadata for sequences with `lens[i]` tokens cached after this step, of which
    `new[i]` are new, each in its own blocks `tables[i]`."""
    from worker.attention import AttentionMetadata

    slots, starts = [], [0]
    for n, k, table in zip(lens, new, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - k, n)]
        starts.append(starts[-1] + k)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(new),
        max_seq_len=max(lens),
    )


class Runner:
    """Flat-batch forward passes of one model over its own paged KV cache (one sequence per
    prompt, blocks assigned up front): `prefill` then `decode` steps, or `score` (one pass)."""

    def __init__(self, model, max_len: int, num_seqs: int, block_size: int = 16, backend: str = "torch"):
        from worker.attention import get_attention_backend

        cfg = model.config
        self.model, self.block_size = model, block_size
        self.dtype = model.dtype
        per_seq = -(-max_len // block_size)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        shape = (num_seqs * per_seq, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(cfg.num_layers)
        ]
        self.backend = get_attention_backend(backend, torch.device("cpu"), model.dtype)  # as served

    @torch.inference_mode()
    def forward(self, seqs: list[list[int]], done: list[int]) -> torch.Tensor:
        """Run the tokens seqs[i][done[i]:] of each sequence; float32 logits of every new token."""
        ids = [t for s, d in zip(seqs, done) for t in s[d:]]
        pos = [p for s, d in zip(seqs, done) for p in range(d, len(s))]
        meta = _metadata(
            [len(s) for s in seqs],
            [len(s) - d for s, d in zip(seqs, done)],
            self.block_size,
            self.tables[: len(seqs)],
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta, self.backend)
        return self.model.compute_logits(hidden)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        seqs = [list(p) for p in prompts]
        done = [0] * len(seqs)
        for _ in range(n):
            logits = self.forward(seqs, done)
            last = torch.tensor([len(s) - d for s, d in zip(seqs, done)]).cumsum(0) - 1
            done = [len(s) for s in seqs]
            for s, t in zip(seqs, logits[last].argmax(-1).tolist()):
                s.append(t)
        return [s[len(p) :] for s, p in zip(seqs, prompts)]

    def score(self, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits [len(output), V] predicting each output token."""
        seqs = [p + o[:-1] for p, o in zip(prompts, outputs)]
        logits = self.forward(seqs, [0] * len(seqs))
        out, start = [], 0
        for p, s in zip(prompts, seqs):
            out.append(logits[start + len(p) - 1 : start + len(s)])
            start += len(s)
        return out


def compare(ref_logits, ref_tokens, logits, tokens) -> dict:
    max_abs = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    total = sum(a.numel() for a in logits)
    mean_abs = sum(float((a - b).abs().sum()) for a, b in zip(logits, ref_logits)) / total
    max_rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits))
    agree = sum(int((a.argmax(-1) == torch.tensor(t)).sum()) for a, t in zip(logits, ref_tokens))
    n_tok = sum(len(t) for t in ref_tokens)
    first = []
    for r, t in zip(ref_tokens, tokens):
        diff = [i for i, (x, y) in enumerate(zip(r, t)) if x != y]
        first.append(diff[0] if diff else len(r))
    return {
        "logits_max_abs": max_abs,
        "logits_mean_abs": mean_abs,
        "logits_max_rel": max_rel,
        "teacher_forced_top1_agreement": agree / n_tok,
        "free_running_identical_tokens": sum(f for f in first) / n_tok,
        "first_divergence": first,
        "prompts_fully_identical": sum(f == len(r) for f, r in zip(first, ref_tokens)),
    }


def rss_mib() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def measure_load(dtype: str, quantization: str, threads: int) -> dict:
    """In this (fresh) process: imports and warm-up first, then one load, then RSS deltas."""
    torch.set_num_threads(threads)
    from common.model_files import default_model_path
    from worker.model.loader import load_model, release_freed_memory

    with torch.device("meta"):  # first meta init imports torch._refs (seconds)
        torch.nn.Linear(2, 2), torch.nn.Embedding(2, 2)
    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    before = rss_mib()
    start = time.perf_counter()
    loaded = load_model(None, dtype, "cpu", quantization=quantization)
    load_s = time.perf_counter() - start
    after = rss_mib()
    tensors = {id(t): t for t in list(loaded.model.parameters()) + list(loaded.model.buffers())}
    return {
        "load_s": load_s,
        "resident_mib": after["VmRSS"] - before["VmRSS"],
        "peak_mib": after["VmHWM"] - before["VmRSS"],
        "tensor_mib": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
        "file_mib": os.path.getsize(default_model_path()) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--kernels",
        metavar="ROWS",
        help="instead: the kernel timing sweep at these comma-separated row counts (e.g. 1,4,16,64,512)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--measure-load", nargs=2, metavar=("DTYPE", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_load:
        print(json.dumps(measure_load(*args.measure_load, args.threads)))
        return
    if args.kernels:
        torch.set_num_threads(args.threads)
        from benchmarks.quant_kernels import kernel_sweep

        res = kernel_sweep([int(r) for r in args.kernels.split(",")], args.reps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "kernels": res}, f, indent=1)
        return
    torch.set_num_threads(args.threads)
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer
    from worker.model.loader import load_model

    tok = Tokenizer.from_gguf(default_model_path())
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    max_len = max(map(len, prompts)) + args.tokens
    results: dict = {"prompts": len(prompts), "tokens": args.tokens, "threads": args.threads, "forms": {}}
    ref_tokens = ref_logits = None
    for label, (dtype, quant, served) in FORMS.items():
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.quant_accuracy",
                "--measure-load",
                dtype,
                quant,
                "--threads",
                str(args.threads),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        load = json.loads(child.stdout.splitlines()[-1])
        model = load_model(None, dtype, "cpu", quantization=quant).model
        paths = {}
        if served:
            from worker.model.cpu_paths import apply_cpu_paths

            paths = apply_cpu_paths(model)
        runner = Runner(model, max_len, len(prompts))
        start = time.perf_counter()
        tokens = runner.greedy(prompts, args.tokens)
        gen_s = time.perf_counter() - start
        if ref_tokens is None:
            ref_tokens = tokens
        logits = runner.score(prompts, ref_tokens)
        if ref_logits is None:
            ref_logits = logits
        row = {
            "dtype": dtype,
            "quantization": quant,
            "cpu_paths": paths,
            **load,
            "generate_s": gen_s,
            **compare(ref_logits, ref_tokens, logits, tokens),
        }
        results["forms"][label] = row
        print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'first_divergence'})}", flush=True)
        del model, runner
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def report(res: dict) -> str:
    lines = [
        f"{res['prompts']} prompts x {res['tokens']} greedy tokens, {res['threads']} threads, "
        "vs the float32 reference\n",
        "| form | logits max abs | mean abs | max rel | teacher-forced top-1 | free-running identical "
        "| prompts identical | weights MiB (x file) | load peak MiB | load s | generate s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in res["forms"].items():
        lines.append(
            f"| {label} | {r['logits_max_abs']:.3f} | {r['logits_mean_abs']:.4f} | {r['logits_max_rel']:.4f} "
            f"| {100 * r['teacher_forced_top1_agreement']:.1f}% "
            f"| {100 * r['free_running_identical_tokens']:.1f}% "
            f"| {r['prompts_fully_identical']}/{res['prompts']} "
            f"| {r['resident_mib']:.1f} ({r['resident_mib'] / r['file_mib']:.2f}x of {r['file_mib']:.1f}) "
            f"| {r['peak_mib']:.1f} | {r['load_s']:.1f} | {r['generate_s']:.1f} |"
        )
    lines.append(f"\nfirst divergence per prompt (token index; {res['tokens']} = identical throughout):")
    for label, r in res["forms"].items():
        lines.append(f"- {label}: {r['first_divergence']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
