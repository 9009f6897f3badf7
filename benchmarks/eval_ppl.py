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
  Q4_1 kept quantized where the loader does so; whatever it returns is run the same way). Each
  chunk is one forward pass of the model's own code with a paged KV cache of that dtype and the
  engine's default CPU attention backend; logits are float32 (the model's `compute_logits`).
- Output: a table (PPL, +/-, tokens scored, seconds) and `quantized vs float32: +N.NN%`, written
  as the "Perplexity (make eval)" section of docs/benchmarks.md (other sections untouched) when
  every row succeeded; JSON to results/eval_ppl/<UTC time>.json. The target in the docs: the
  quantized path within 1% of float32.
- failure modes: a variant that fails to load or run is reported with its error and the exit
  status is 1 (docs not rewritten); a failed llama.cpp build or llama-perplexity run likewise.
- `perplexity(tokens, n_ctx, logits_fn, ...)` is the model-free arithmetic (tested with known
  answers in tests/test_eval_ppl.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = REPO / "benchmarks" / "data" / "time_machine_ch1-4.txt"
RESULTS = REPO / "results" / "eval_ppl"
SECTION = "Perplexity (make eval)"
N_CTX = 512
TARGET_PCT = 1.0
# (label, dtype, quantization) in the order of the table
VARIANTS = (
    ("float32", "float32", "none"),
    ("bf16 (dequantized)", "bfloat16", "none"),
    ("quantized (bf16, auto)", "bfloat16", "auto"),
)
PPL_TIMEOUT_S = 1800.0


@dataclass
class PplResult:
    ppl: float
    uncertainty: float
    count: int  # tokens scored
    num_chunks: int
    chunk_ppls: list[float] = field(default_factory=list)  # running estimate after each chunk


def read_text(path: pathlib.Path) -> str:
    """The file as llama-perplexity's `-f` reads it: one trailing newline removed."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def num_chunks(num_tokens: int, n_ctx: int) -> int:
    """Chunks llama-perplexity scores: len // n_ctx; it refuses fewer than 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise ValueError(f"context must be >= 4 tokens, got {n_ctx}")
    if num_tokens < 2 * n_ctx:
        raise ValueError(
            f"need at least {2 * n_ctx} tokens for a context of {n_ctx}, the text has {num_tokens}"
        )
    return num_tokens // n_ctx


def chunk_input(tokens: Sequence[int], index: int, n_ctx: int, bos_id: int | None) -> list[int]:
    """Chunk `index` as the model sees it: its first token replaced by BOS when add_bos."""
    ids = list(tokens[index * n_ctx : (index + 1) * n_ctx])
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def scored_targets(tokens: Sequence[int], index: int, n_ctx: int) -> list[int]:
    """The tokens chunk `index` is scored on: those after positions first..n_ctx-2."""
    first = n_ctx // 2
    start = index * n_ctx
    return list(tokens[start + first + 1 : start + n_ctx])


def token_nll(logits, targets):
    """-log softmax(logits)[target] per row, float64 (rows: [n, vocab] tensor, targets: [n])."""
    import torch

    logits = logits.to(torch.float64)
    targets = torch.as_tensor(targets, dtype=torch.int64)
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]


def perplexity(
    tokens: Sequence[int],
    n_ctx: int,
    logits_fn: Callable[[list[int], int], object],
    bos_id: int | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PplResult:
    """llama-perplexity's method (module docstring). `logits_fn(chunk_ids, first)` returns the
    logits of positions first..n_ctx-2 of the chunk, shape [n_ctx - first - 1, vocab]."""
    n_chunk = num_chunks(len(tokens), n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunk):
        logits = logits_fn(chunk_input(tokens, i, n_ctx, bos_id), first)
        targets = scored_targets(tokens, i, n_ctx)
        if tuple(logits.shape[:1]) != (len(targets),):
            raise ValueError(f"logits_fn gave {tuple(logits.shape)} rows for {len(targets)} targets")
        values = token_nll(logits, targets)
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        count += len(targets)
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk, running[-1])
    mean, mean2 = nll / count, nll2 / count
    var = mean2 - mean * mean
    ppl = math.exp(mean)
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PplResult(ppl, unc, count, n_chunk, running)


class ModelScorer:
    """`logits_fn` over one of our models: each chunk one forward pass from an empty paged KV
    cache (one sequence, positions 0..n-1), the default CPU attention backend, float32 logits."""

    def __init__(self, model, dtype: str, block_size: int = 16, attention_backend: str = "auto"):
        import torch

        from worker.attention import get_attention_backend

        self.model = model
        self.cfg = model.config
        self.dtype = getattr(torch, dtype)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend, torch.device("cpu"))

    def __call__(self, ids: list[int], first: int):
        import torch

        from worker.attention import AttentionMetadata

        n, bs, cfg = len(ids), self.block_size, self.cfg
        num_blocks = -(-n // bs)
        shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        kv = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(cfg.num_layers)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64),
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64),
                torch.arange(n, dtype=torch.int64),
                kv,
                meta,
                self.backend,
            )
            return self.model.compute_logits(hidden[first : n - 1]).float()


def weight_summary(model) -> dict[str, float]:
    """MiB of parameters and buffers per dtype: shows what the loader kept quantized."""
    out: dict[str, float] = {}
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0.0) + t.numel() * t.element_size() / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items())}


def tokenize(model_path: pathlib.Path, text: str) -> tuple[list[int], int | None]:
    """Token ids of the whole text and the BOS id to put first in each chunk (None: add_bos off)."""
    from common.model_files import read_gguf_metadata
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model_path)
    meta = read_gguf_metadata(model_path)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    ids = tok.encode(text)
    bos = meta.get("tokenizer.ggml.bos_token_id") if add_bos else None
    if add_bos and bos is not None:
        ids = [int(bos), *ids]
    return ids, (int(bos) if add_bos and bos is not None else None)


def run_ours(
    model_path: pathlib.Path,
    dtype: str,
    quantization: str,
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
    by = {r["label"]: r for r in rows if "ppl" in r}
    if "float32" not in by or VARIANTS[2][0] not in by:
        return "quantized vs float32: n/a (a row failed)"
    pct = pct_change(by[VARIANTS[2][0]]["ppl"], by["float32"]["ppl"])
    met = "met" if abs(pct) <= TARGET_PCT else "NOT met"
    return f"quantized vs float32: {pct:+.2f}% (target within {TARGET_PCT:g}%: {met})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.eval_ppl",
        description="perplexity: our float32 / bf16 / quantized paths and llama-perplexity",
    )
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--text", default=str(TEXT), help="UTF-8 text file (default: the bundled one)")
    p.add_argument("--ctx", type=int, default=N_CTX, help="context per chunk (llama-perplexity -c)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--variants", default="all", help="comma-separated: float32,bf16,quantized (or all)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip llama-perplexity")
    p.add_argument("--cache-dir", default=None, help="llama.cpp build cache (see benchmarks/llamacpp.py)")
    p.add_argument("--no-docs", dest="docs", action="store_false", help="do not rewrite docs/benchmarks.md")
    a = p.parse_args(argv)
    keys = {"float32": VARIANTS[0], "bf16": VARIANTS[1], "quantized": VARIANTS[2]}
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
    for label, dtype, quant in a.variant_list:
        log(f"  {label}: load_model(dtype={dtype}, quantization={quant}) ...")
        try:
            row = run_ours(model_path, dtype, quant, tokens, bos, a.ctx, a.threads, log)
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
    if a.llamacpp:
        from benchmarks.llamacpp import BuildError, ensure_built

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
