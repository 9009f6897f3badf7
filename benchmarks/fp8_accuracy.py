"""FP8 weight accuracy on CPU: the embedded SmolLM2-135M in bfloat16 (the reference) vs fp8 forms.

Contract: `python -m benchmarks.fp8_accuracy [--prompts 8] [--tokens 32] [--threads 2]
[--variants a,b] [--json PATH]` prints one markdown table (and writes JSON when asked). No GPU:
accuracy is a property of the formula, not of the device.
- Prompts: the GPU checkpoint section's text prompts (benchmarks/gpu_checkpoint.checkpoint_prompts),
  run as one flat batch with the "torch" attention backend (benchmarks/quant_accuracy.Runner).
- Per variant, with the metrics of benchmarks/gpu_fp8.py's checkpoint part: relative max logit
  error (max |v - bf16| / max |bf16| per row) of the first greedy step (median / max over the
  prompts) and of every free-running step before the request's first divergence (median / max),
  identical requests, first token equal, share of tokens before the first divergence; plus
  teacher-forced on bf16's own tokens (one early flip cannot cascade): top-1 agreement and the
  relative error (median / max over positions).
- Variants: `fp32` (the bf16 reference's own rounding, for scale), the real modules of
  worker/model/fp8.py (`Fp8Linear` as `--quantization fp8` builds it: W8A8 `_scaled_mm` at prefill,
  per-channel or per-group weight scales), and formula simulations (`SimFp8Linear`: the
  dequantized operands multiplied in float32 and rounded once, i.e. what a kernel computes up
  to the summation order) for the forms no module implements: weight scales per channel or per
  group of K columns, activations unquantized (W8A16), per token, or per token and group;
  selected layer types kept in bf16.
State: none; ~3 s per variant on 2 vCPUs after a ~5 s load. Proven by running it: the table in
docs/quantization.md ("FP8") is its output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

from worker.model.fp8 import FP8, FP8_MAX, quantize_model_fp8

LAYER_TYPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fake_quant(t: torch.Tensor, group: int) -> torch.Tensor:
    """t [R, K] rounded to e4m3 with one scale per row (group 0) or per `group` columns of a row
    (the last group may be shorter), returned dequantized in float32."""
    t = t.float()
    if group <= 0 or group >= t.shape[1]:
        group = t.shape[1]
    out = torch.empty_like(t)
    for k0 in range(0, t.shape[1], group):
        part = t[:, k0 : k0 + group]
        amax = part.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[:, k0 : k0 + group] = (part / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return out


class SimFp8Linear(nn.Module):
    """`act(x) @ fake_quant(W, w_group).T + b` in float32, rounded once to the layer's dtype; act:
    None (W8A16), or fake_quant(x, a_group) (a_group 0 = per token)."""

    def __init__(self, linear: nn.Linear, w_group: int, a_group: int | None):
        super().__init__()
        self.weight = fake_quant(linear.weight.detach(), w_group)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.a_group, self.out_dtype = a_group, linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xf = x2.float() if self.a_group is None else fake_quant(x2, self.a_group)
        out = xf @ self.weight.T
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.out_dtype).reshape(*x.shape[:-1], -1)


def convert(model: nn.Module, make, keep: tuple[str, ...] = ()) -> int:
    """Replace each decoder nn.Linear whose name is not in `keep` by make(linear)."""
    count = 0
    for layer in model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name not in keep:
                    setattr(parent, name, make(child))
                    count += 1
    return count


def sim(w_group: int, a_group: int | None, keep: tuple[str, ...] = ()):
    return lambda model: convert(model, lambda lin: SimFp8Linear(lin, w_group, a_group), keep)


def grouped(group: int):
    return lambda model: quantize_model_fp8(model, group)


def only(layer_type: str):
    return sim(0, 0, tuple(t for t in LAYER_TYPES if t != layer_type))


# name -> (model dtype, how to convert the loaded model in place, what it is)
VARIANTS = {
    "bf16": ("bfloat16", None, "reference"),
    "fp32": ("float32", None, "float32 model: the reference's own rounding"),
    "Fp8Linear w8a8 ch": (
        "bfloat16",
        grouped(0),
        "the module: _scaled_mm, per-channel (the old default)",
    ),
    "Fp8Linear g128": (
        "bfloat16",
        grouped(128),
        "the module: per-128-column scales, W8A16 (the new default)",
    ),
    "Fp8Linear g64": ("bfloat16", grouped(64), "the module: per-64-column scales, W8A16"),
    "sim w8a8 ch": ("bfloat16", sim(0, 0), "formula: per-channel weight, per-token act (the old default)"),
    "sim w8a16 ch": ("bfloat16", sim(0, None), "formula: per-channel weight, bf16 act"),
    "sim w8a16 g128": ("bfloat16", sim(128, None), "formula: per-(channel, 128 cols) weight, bf16 act"),
    "sim w8a16 g64": ("bfloat16", sim(64, None), "formula: per-(channel, 64 cols) weight, bf16 act"),
    "sim w8a16 g32": ("bfloat16", sim(32, None), "formula: per-(channel, 32 cols) weight, bf16 act"),
    "sim w8a16 g64 down-bf16": (
        "bfloat16",
        sim(64, None, ("down_proj",)),
        "formula: W8A16 g64, down_proj bf16",
    ),
    "sim w8a8 g128 a128": ("bfloat16", sim(128, 128), "formula: g128 weight, per-(token, 128 cols) act"),
    "sim w8a8 ch a128": ("bfloat16", sim(0, 128), "formula: per-channel weight, per-(token, 128 cols) act"),
    "sim w8a8 g128": ("bfloat16", sim(128, 0), "formula: g128 weight, per-token act"),
    "sim w8a8 ch down-bf16": ("bfloat16", sim(0, 0, ("down_proj",)), "formula: W8A8 ch, down_proj bf16"),
    "sim w8a16 ch down-bf16": ("bfloat16", sim(0, None, ("down_proj",)), "formula: W8A16 ch, down_proj bf16"),
    "sim w8a8 qkv only": ("bfloat16", only("qkv_proj"), "formula: W8A8 ch on qkv_proj only"),
    "sim w8a8 o only": ("bfloat16", only("o_proj"), "formula: W8A8 ch on o_proj only"),
    "sim w8a8 gate_up only": ("bfloat16", only("gate_up_proj"), "formula: W8A8 ch on gate_up_proj only"),
    "sim w8a8 down only": ("bfloat16", only("down_proj"), "formula: W8A8 ch on down_proj only"),
}


def greedy(runner, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Free-running greedy tokens and each step's float32 logits row per prompt."""
    seqs = [list(p) for p in prompts]
    done = [0] * len(seqs)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(n):
        logits = runner.forward(seqs, done)
        last = torch.tensor([len(s) - d for s, d in zip(seqs, done)]).cumsum(0) - 1
        done = [len(s) for s in seqs]
        for i, (s, row) in enumerate(zip(seqs, logits[last])):
            rows[i].append(row)
            s.append(int(row.argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts)], rows


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative max error of each row of a against b: max |a - b| / max |b|."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


def compare(ref: dict, got: dict) -> dict:
    first = [float(rel(a[0], b[0])) for a, b in zip(got["rows"], ref["rows"])]
    div = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        for a, b in zip(got["tokens"], ref["tokens"])
    ]
    every = [
        float(rel(a[j], b[j]))
        for a, b, d in zip(got["rows"], ref["rows"], div)
        for j in range(min(d + 1, len(b)))
    ]
    tf = torch.cat([rel(a, b) for a, b in zip(got["scored"], ref["scored"])])
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got["scored"], ref["scored"]))
    n = len(ref["tokens"])
    return dict(
        first_step_rel_err_median=statistics.median(first),
        first_step_rel_err_max=max(first),
        steps_rel_err_median=statistics.median(every),
        steps_rel_err_max=max(every),
        identical=sum(d == len(b) for d, b in zip(div, ref["tokens"])),
        first_token_equal=sum(a[:1] == b[:1] for a, b in zip(got["tokens"], ref["tokens"])),
        requests=n,
        tokens_before_first_divergence=sum(div) / sum(len(b) for b in ref["tokens"]),
        tf_top1=agree / int(tf.numel()),
        tf_rel_err_median=float(tf.median()),
        tf_rel_err_max=float(tf.max()),
    )


def run_variant(name: str, prompts, n: int, ref_tokens) -> dict:
    from benchmarks.quant_accuracy import Runner
    from worker.model.loader import load_model

    dtype, make, _ = VARIANTS[name]
    model = load_model(None, dtype, "cpu", quantization="none").model
    converted = 0 if make is None else make(model)
    runner = Runner(model, max(map(len, prompts)) + n, len(prompts))
    start = time.perf_counter()
    tokens, rows = greedy(runner, prompts, n)
    scored = runner.score(prompts, ref_tokens or tokens)
    return dict(tokens=tokens, rows=rows, scored=scored, converted=converted, s=time.perf_counter() - start)


def report(results: dict, meta: dict) -> str:
    lines = [
        f"{meta['prompts']} prompts x {meta['tokens']} greedy tokens, reference bf16; errors are "
        "relative max logit errors (max |v - bf16| / max |bf16| per row).",
        "",
        "| variant | first step median / max | free-running steps median / max | identical | first token "
        "| tokens before divergence | teacher-forced top-1 | teacher-forced median / max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['first_step_rel_err_median']:.3f} / {r['first_step_rel_err_max']:.3f} "
            f"| {r['steps_rel_err_median']:.3f} / {r['steps_rel_err_max']:.3f} "
            f"| {r['identical']}/{r['requests']} | {r['first_token_equal']}/{r['requests']} "
            f"| {r['tokens_before_first_divergence']:.1%} | {r['tf_top1']:.1%} "
            f"| {r['tf_rel_err_median']:.3f} / {r['tf_rel_err_max']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", help="comma-separated names (default: all): " + ", ".join(VARIANTS))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from benchmarks.gpu_checkpoint import checkpoint_prompts
    from common.model_files import default_model_path

    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    prompts, kind = checkpoint_prompts(default_model_path(), args.prompts, 49152)
    meta = dict(prompts=len(prompts), tokens=args.tokens, prompt_kind=kind, threads=args.threads)
    ref = run_variant("bf16", prompts, args.tokens, None)
    results = {}
    for name in [v for v in names if v != "bf16"]:
        got = run_variant(name, prompts, args.tokens, ref["tokens"])
        results[name] = dict(compare(ref, got), converted=got["converted"], seconds=got["s"])
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(report(results, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
