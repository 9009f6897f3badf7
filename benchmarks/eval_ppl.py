"""`make eval`: perplexity of our model on a bundled public-domain English text, in float32, bf16
(dequantized) and the quantized path, with llama.cpp's `llama-perplexity` on the same GGUF and
text as the peer figure.

Contract
- Text: benchmarks/data/time_machine_ch1-4.txt (H. G. Wells, The Time Machine, chapters I-IV,
  Project Gutenberg eBook #35, public domain; benchmarks/data/README.md). No network at run time
  (building llama-perplexity the first time downloads the llama-cpp-python sdist; --no-llamacpp
  skips it).
- Method, as llama-perplexity's `perplexity()` (tools/perplexity/perplexity.cpp, sdist of
  llama-cpp-python 0.3.36) with its defaults: the text, less one trailing newline (its `-f`
  strips it), is tokenized whole (BOS only when the GGUF says `add_bos_token`); it is cut into
  `n_chunk = len(tokens) // n_ctx` non-overlapping chunks of `n_ctx` tokens (the tail is dropped;
  at least 2 chunks are needed); each chunk runs from an empty KV cache at positions 0..n_ctx-1,
  its first token replaced by BOS when add_bos; only the second half is scored: the logits at
  positions first..n_ctx-2 (first = n_ctx // 2) against the next tokens, `n_ctx - first - 1`
  tokens per chunk. NLL = logsumexp(logits) - logit[target] (float64 sums); PPL = exp(mean NLL);
  its +/- = PPL * sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1)), as llama.cpp prints it.
- Our variants, each built through `worker.model.loader.load_model(path, dtype, "cpu",
  quantization=...)`: float32 + "none", bfloat16 + "none" (dequantized), bfloat16 + "auto" (GGUF
  Q4_1 kept quantized where the loader does so; whatever it returns is run the same way) on the
  weight-only kernels (bfloat16 activations), and bfloat16 + "auto" as a CPU worker serves it:
  `worker.model.cpu_paths.apply_cpu_paths` with the default EngineConfig (int8 activations on
  AVX512-VNNI and AVX2 CPUs, dequantize-then-GEMM for many rows), the modules it converted in the row. Each
  chunk is one forward pass of the model's own code with a paged KV cache of that dtype and the
  engine's default CPU attention backend; logits are float32 (the model's `compute_logits`).
- Output: a table (PPL, +/-, tokens scored, seconds) and `quantized vs float32: +N.NN%` (the
  served path's row; the weight-only row's figure after it when both ran), written
  as the "Perplexity (make eval)" section of docs/benchmarks.md (other sections untouched) when
  every row succeeded; JSON to results/eval_ppl/<UTC time>.json. The target in the docs: the
  quantized path within 1% of float32.
- failure modes: a variant that fails to load or run is reported with its error and the exit
  status is 1 (docs not rewritten); a failed llama.cpp build or llama-perplexity run likewise.
- The method (text, tokens, chunks, NLL, the model as a `logits_fn`): benchmarks/ppl_method.py,
  whose `perplexity(tokens, n_ctx, logits_fn, ...)` is the model-free arithmetic (tested with known
  answers in tests/test_eval_ppl.py). Here: the variants run (ours and llama-perplexity), the report
  and the verdict, the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone

from benchmarks.ppl_method import ModelScorer, num_chunks, perplexity, read_text, tokenize, weight_summary

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = REPO / "benchmarks" / "data" / "time_machine_ch1-4.txt"
RESULTS = REPO / "results" / "eval_ppl"
SECTION = "Perplexity (make eval)"
N_CTX = 512
TARGET_PCT = 1.0
# (label, dtype, quantization, served CPU paths) in the order of the table
VARIANTS = (
    ("float32", "float32", "none", False),
    ("bf16 (dequantized)", "bfloat16", "none", False),
    ("quantized (bf16, auto)", "bfloat16", "auto", False),
    ("quantized as served (CPU paths)", "bfloat16", "auto", True),
)
WEIGHT_ONLY, SERVED = VARIANTS[2][0], VARIANTS[3][0]
PPL_TIMEOUT_S = 1800.0


def run_ours(
    model_path: pathlib.Path,
    dtype: str,
    quantization: str,
    cpu_paths: bool,
    tokens: list[int],
    bos: int | None,
    n_ctx: int,
    threads: int,
    log,
) -> dict:
    import torch

    from worker.model.loader import load_model

    torch.set_num_threads(threads)
    started = time.perf_counter()
    loaded = load_model(model_path, dtype, "cpu", quantization=quantization)
    paths = {}
    if cpu_paths:
        from worker.model.cpu_paths import apply_cpu_paths

        paths = apply_cpu_paths(loaded.model)
    load_s = time.perf_counter() - started
    weights = weight_summary(loaded.model)
    scorer = ModelScorer(loaded.model, dtype)
    started = time.perf_counter()

    def progress(i: int, n: int, running: float) -> None:
        if i % 4 == 0 or i == n:
            log(f"    chunk {i}/{n}: running PPL {running:.4f}")

    result = perplexity(tokens, n_ctx, scorer, bos, on_chunk=progress)
    return {
        **asdict(result),
        "seconds": round(time.perf_counter() - started, 1),
        "load_s": round(load_s, 1),
        "weights_mib": weights,
        "cpu_paths": paths,
        "attention_backend": scorer.backend.name,
    }


def run_llamacpp(
    binary: pathlib.Path, model_path: pathlib.Path, text_path: pathlib.Path, n_ctx: int, threads: int
) -> dict:
    from benchmarks.llamacpp import parse_chunk_ppls, parse_num_chunks, parse_perplexity

    cmd = [str(binary), "-m", str(model_path), "-f", str(text_path), "-c", str(n_ctx), "-t", str(threads)]
    started = time.perf_counter()
    try:  # one stream, in order: the chunk estimates (stdout) follow the log lines (stderr)
        done = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=PPL_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"llama-perplexity not done within {PPL_TIMEOUT_S:.0f} s") from None
    output = done.stdout
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}:\n{output[-2000:]}")
    ppl, unc = parse_perplexity(output)
    n_chunk = parse_num_chunks(output)
    return {
        "ppl": ppl,
        "uncertainty": unc,
        "num_chunks": n_chunk,
        "chunk_ppls": parse_chunk_ppls(output),
        "count": n_chunk * (n_ctx - n_ctx // 2 - 1),
        "seconds": round(time.perf_counter() - started, 1),
        "command": shlex.join(cmd),
        "output_tail": output[-1500:],
    }


def pct_change(value: float, base: float) -> float:
    return (value / base - 1.0) * 100.0


def report_markdown(run: dict) -> str:
    m, rows = run["machine"], run["rows"]
    base = next((r for r in rows if r["label"] == "float32" and "ppl" in r), None)
    lines = [
        f"## {SECTION}",
        "",
        f"`make eval` on {run['date']}: {m['cpu']}, {m['cores']} cores; commit `{run['commit']}`; "
        f"model `{run['model_name']}` ({pathlib.Path(run['model']).name}); text "
        f"`{run['text']}` ({run['text_bytes']:,} bytes, {run['num_tokens']:,} tokens: The Time Machine, "
        "chapters I-IV, public domain); context "
        f"{run['n_ctx']}, {run['num_chunks']} non-overlapping chunks, the second half of each scored "
        f"({run['n_ctx'] - run['n_ctx'] // 2 - 1} tokens per chunk), as llama-perplexity does; "
        f"{run['threads']} threads.",
        "",
        "| model path | PPL | ± | vs float32 | tokens scored | seconds | weights held |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "ppl" not in r:
            lines.append(f"| {r['label']} | error | | | | | {r.get('error', '')[:120]} |")
            continue
        delta = f"{pct_change(r['ppl'], base['ppl']):+.2f}%" if base else "–"
        weights = (
            ", ".join(f"{k} {v:,.0f} MiB" for k, v in r.get("weights_mib", {}).items()) or "GGUF as stored"
        )
        if r.get("cpu_paths"):
            p = r["cpu_paths"]
            weights += (
                f"; int8 activations in {p['int8_activation_modules']} modules, "
                f"dequantize-then-GEMM in {p['dequant_gemm_modules']}"
            )
        lines.append(
            f"| {r['label']} | {r['ppl']:.4f} | {r['uncertainty']:.4f} | {delta} | {r['count']:,} | "
            f"{r['seconds']:.1f} | {weights} |"
        )
    peer = next((r for r in rows if r["label"].startswith("llama.cpp") and "ppl" in r), None)
    if peer is not None:
        same = peer["num_chunks"] == run["num_chunks"]
        agree = (
            f"llama-perplexity cut the text into the same {peer['num_chunks']} chunks"
            if same
            else f"llama-perplexity cut the text into {peer['num_chunks']} chunks, "
            f"we into {run['num_chunks']}: "
            "the tokenizers disagree on this text, so its figure is not strictly comparable"
        )
    else:
        agree = "llama-perplexity did not run"
    lines += [
        "",
        f"**{run['verdict']}**",
        "",
        "Target: the quantized path within 1% of float32. Every row runs the same weights: the "
        'GGUF stores them as Q4_1, and "float32" is their exact dequantization, so the comparison '
        "isolates what our bf16 activations and quantized kernels add, not Q4_1's own loss against "
        "the original model. The ± is llama.cpp's estimate of the statistical error of one figure "
        "over this text; the rows share the text, so their differences are far tighter than that. "
        "llama.cpp's figure is its own kernels on the same GGUF and text, the peer for the quantized "
        f"path; {agree}.",
        "",
        "Commands:",
        "",
        "```",
        run["command"],
    ]
    if run.get("llamacpp_command"):
        lines.append(
            run["llamacpp_command"].replace(str(pathlib.Path.home()), "~").replace(str(REPO) + "/", "")
        )
    lines += ["```", f"Raw numbers: `{run['json']}` (not committed).", ""]
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The served path's row against float32 (the weight-only row's when the served one did not
    run), the other quantized row's figure appended."""
    by = {r["label"]: r for r in rows if "ppl" in r}
    ran = [r["label"] for r in rows]
    main = SERVED if SERVED in ran else WEIGHT_ONLY
    if "float32" not in by or main not in by:
        return "quantized vs float32: n/a (a row failed)"
    pct = pct_change(by[main]["ppl"], by["float32"]["ppl"])
    met = "met" if abs(pct) <= TARGET_PCT else "NOT met"
    text = f"quantized vs float32: {pct:+.2f}% (target within {TARGET_PCT:g}%: {met})"
    if main == SERVED and WEIGHT_ONLY in by:
        text += f"; bf16-activation kernels {pct_change(by[WEIGHT_ONLY]['ppl'], by['float32']['ppl']):+.2f}%"
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.eval_ppl",
        description="perplexity: our float32 / bf16 / quantized paths and llama-perplexity",
    )
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--text", default=str(TEXT), help="UTF-8 text file (default: the bundled one)")
    p.add_argument("--ctx", type=int, default=N_CTX, help="context per chunk (llama-perplexity -c)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument(
        "--variants", default="all", help="comma-separated: float32,bf16,quantized,served (or all)"
    )
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip llama-perplexity")
    p.add_argument(
        "--cache-dir", default=None, help="llama.cpp build cache (see benchmarks/llamacpp_build.py)"
    )
    p.add_argument("--no-docs", dest="docs", action="store_false", help="do not rewrite docs/benchmarks.md")
    a = p.parse_args(argv)
    keys = {"float32": VARIANTS[0], "bf16": VARIANTS[1], "quantized": VARIANTS[2], "served": VARIANTS[3]}
    if a.variants == "all":
        a.variant_list = list(VARIANTS)
    else:
        try:
            a.variant_list = [keys[v.strip()] for v in a.variants.split(",") if v.strip()]
        except KeyError as exc:
            p.error(f"unknown variant {exc}; known: {', '.join(keys)}")
    if a.ctx < 4 or a.threads < 1:
        p.error("--ctx must be >= 4 and --threads >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    from benchmarks.host_stats import machine_info
    from benchmarks.report import git_short, write_section
    from common.model_files import default_model_path, read_gguf_metadata

    model_path = pathlib.Path(a.model) if a.model else default_model_path()
    text_path = pathlib.Path(a.text)
    if not model_path.is_file() or not text_path.is_file():
        missing = model_path if not model_path.is_file() else text_path
        log(f"eval: no such file: {missing}")
        return 1
    started = datetime.now(timezone.utc)
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{started:%Y%m%d-%H%M%S}.json"
    text = read_text(text_path)
    tokens, bos = tokenize(model_path, text)
    try:
        n_chunk = num_chunks(len(tokens), a.ctx)
    except ValueError as exc:
        log(f"eval: {exc}")
        return 1
    try:
        rel_text = str(text_path.resolve().relative_to(REPO))
    except ValueError:
        rel_text = str(text_path)
    run = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "commit": git_short(),
        "command": shlex.join(
            ["python", "-m", "benchmarks.eval_ppl", *(sys.argv[1:] if argv is None else argv)]
        ),
        "model": str(model_path),
        "model_name": read_gguf_metadata(model_path).get("general.name", model_path.name),
        "text": rel_text,
        "text_bytes": len(text.encode("utf-8")),
        "num_tokens": len(tokens),
        "n_ctx": a.ctx,
        "num_chunks": n_chunk,
        "threads": a.threads,
        "add_bos": bos is not None,
        "json": str(json_path.relative_to(REPO)),
        "rows": [],
    }
    log(
        f"eval: {run['model_name']}, {rel_text}: {len(tokens):,} tokens, {n_chunk} chunks of {a.ctx}, "
        f"{a.threads} threads"
    )
    failed = False
    for label, dtype, quant, cpu_paths in a.variant_list:
        log(f"  {label}: load_model(dtype={dtype}, quantization={quant}) ...")
        try:
            row = run_ours(model_path, dtype, quant, cpu_paths, tokens, bos, a.ctx, a.threads, log)
        except Exception as exc:  # noqa: BLE001 - whatever the loader or model raises: report, go on
            failed = True
            row = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  {label}: FAILED: {row['error']}")
        else:
            log(
                f"  {label}: PPL {row['ppl']:.4f} +/- {row['uncertainty']:.4f} over {row['count']:,} tokens "
                f"in {row['seconds']:.1f} s (weights {row['weights_mib']})"
            )
        run["rows"].append({"label": label, "dtype": dtype, "quantization": quant, **row})
        if cpu_paths and "ppl" in row:
            log(f"  {label}: {row['cpu_paths']}")
    if a.llamacpp:
        from benchmarks.llamacpp_build import BuildError, ensure_built

        label = "llama.cpp llama-perplexity (Q4_1 GGUF)"
        try:
            bins = ensure_built(a.cache_dir, log=log)
            log(f"  {label} ...")
            row = run_llamacpp(bins.perplexity, model_path, text_path, a.ctx, a.threads)
            run["llamacpp_command"] = row["command"]
            log(
                f"  {label}: PPL {row['ppl']:.4f} +/- {row['uncertainty']:.4f} over {row['count']:,} tokens "
                f"({row['num_chunks']} chunks) in {row['seconds']:.1f} s"
            )
        except (BuildError, RuntimeError, ValueError, OSError) as exc:
            failed = True
            row = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  {label}: FAILED: {row['error']}")
        run["rows"].append({"label": label, **row})
    run["verdict"] = verdict(run["rows"])
    json_path.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    md = report_markdown(run)
    log("")
    log(md)
    log(run["verdict"])
    log(f"wrote {json_path}")
    if failed:
        log("eval: FAILED (docs/benchmarks.md left as it was)")
        return 1
    if a.docs:
        from benchmarks.bench_serve import DOCS

        write_section(DOCS, SECTION, md)
        log(f"wrote section '{SECTION}' of {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
