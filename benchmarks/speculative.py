"""Speculative decoding with n-gram drafts, side by side: our stack with and without drafts, and
llama.cpp's llama-server without and with its n-gram speculation, on the same GGUF and prompts.

Contract
- input: `--model` (GGUF; the embedded SmolLM2 by default), `--threads`, `--max-tokens` (128),
  `--rounds` (2: every side runs once per round, the order reversed in the second, so drift on a
  shared machine falls on both), `--skip-llamacpp`; llama-server built once as for
  `make bench-serve` (benchmarks/llamacpp.py).
- protocol: WORKLOADS (copy: repeat a paragraph; edit: rewrite a snippet of code with a change;
  chat: open questions, where earlier text rarely repeats), 4 prompts each, one request at a time
  (the single-user case drafts are for), greedy (temperature 0), POST /v1/chat/completions
  streamed with usage; a side is started alone, sent one unmeasured request, then every prompt.
- output: per side and workload: decode speed (output tokens after the first / seconds from the
  first streamed content to the end), the median time to first content, and for our drafted side
  how many answers equal those of our side without drafts (the same greedy tokens are the
  contract); the drafts made and kept (our worker's /metrics; llama-server's `timings`). A JSON
  file and a markdown table in results/ (docs/benchmarks.md, "Speculative decoding"), the CPU
  model and git revision with it.
- failure modes: a side that fails to start is reported with its log tail and the others still
  run; a failed request is an error in the JSON and is left out of the rates.
- proven by: tests/test_speculative.py (equality with drafts off, in the engine); the servers
  only run here.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.report import REPO, git_short
from benchmarks.serve_sides import LlamaHttpSide, OurHttpSide, run_rounds
from benchmarks.structured_output import _cpu

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the "
    "capital of Germany. Water boils at 100 degrees Celsius at sea level.",
    "Our library opens at nine in the morning and closes at six in the evening. Books can be borrowed "
    "for three weeks, and each card holds up to ten books at a time.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, which contain the green pigment chlorophyll.",
    "To reset your password, open the settings page, choose Security, and click Reset Password. A link "
    "will be sent to your email address; it expires after one hour.",
]
SNIPPETS = [
    (
        "x",
        "count",
        "def f(x):\n    x = x + 1\n    for i in range(x):\n        print(i, x)\n    return x * 2\n",
    ),
    (
        "items",
        "values",
        "def total(items):\n    s = 0\n    for item in items:\n        s += item\n"
        "    return s / len(items)\n",
    ),
    (
        "name",
        "user",
        "def greet(name):\n    if not name:\n        name = 'world'\n"
        "    print('Hello, ' + name)\n    return name\n",
    ),
    ("a", "left", "def add(a, b):\n    c = a + b\n    print(a, b, c)\n    return c\n\nprint(add(1, 2))\n"),
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for staying focused while studying.",
    "What are the main differences between cats and dogs as pets?",
]
WORKLOADS = {
    "copy": [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PARAGRAPHS],
    "edit": [
        f"Rename the variable {old} to {new} in this code and print the whole code:\n\n{code}"
        for old, new, code in SNIPPETS
    ],
    "chat": QUESTIONS,
}


def ask(url: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> dict:
    """One streamed chat completion: its text, output tokens (usage), seconds to the first content
    and to the end; llama-server's draft counts where its last chunk's `timings` has them."""
    body = {
        "model": "",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    row: dict = {"text": "", "first_s": None}
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                content = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if content:
                    row["first_s"] = row["first_s"] or time.perf_counter() - start
                    row["text"] += content
                if chunk.get("usage"):
                    row["tokens"] = chunk["usage"]["completion_tokens"]
                timings = chunk.get("timings") or {}
                if "draft_n" in timings:
                    row["drafts"] = {"drafted": timings["draft_n"], "kept": timings["draft_n_accepted"]}
        if "tokens" not in row or row["first_s"] is None:
            raise ValueError("the stream carried no usage or no content")
    except (OSError, ValueError, KeyError, urllib.error.HTTPError) as exc:
        row = {"error": str(exc)[:300]}
    row["seconds"] = time.perf_counter() - start
    return row


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


class _Ours(OurHttpSide):
    def __init__(
        self, name: str, model: pathlib.Path | None, threads: int, log_dir: pathlib.Path, k: int | None
    ):
        extra = () if k is None else ("--num-speculative-tokens", str(k))
        super().__init__(model, threads, log_dir, worker_extra=("--metrics-port", "0", *extra))
        self.name = name

    def drafts(self) -> dict:
        match = re.search(r"metrics at (http://[^\s,]+)", self.stack.worker.log_text())
        if not match:
            return {}
        with urllib.request.urlopen(match.group(1), timeout=10) as reply:
            text = reply.read().decode()
        return {
            "drafted": _metric(text, "llm_spec_decode_draft_tokens"),
            "kept": _metric(text, "llm_spec_decode_accepted_tokens"),
        }


class _Llama(LlamaHttpSide):
    def __init__(self, name: str, model: pathlib.Path, threads: int, extra: tuple[str, ...]):
        super().__init__(model, threads, parallel=1, ctx_size=4096, extra=extra)
        self.name = name

    def drafts(self) -> dict:
        return {}


def run_side(side, max_tokens: int) -> dict:
    url = side.start()
    try:
        ask(url, QUESTIONS[0], 8)  # unmeasured: first-request costs
        before = side.drafts()
        rows = {name: [ask(url, p, max_tokens) for p in prompts] for name, prompts in WORKLOADS.items()}
        after = side.drafts()
    finally:
        side.stop()
    drafts = {k: after[k] - before.get(k, 0.0) for k in after}
    for row in (r for workload in rows.values() for r in workload if "drafts" in r):  # llama-server's
        for key, value in row["drafts"].items():
            drafts[key] = drafts.get(key, 0.0) + value
    return {"rows": rows, "drafts": drafts}


def summarize(results: dict, reference: str) -> dict:
    """{side: {workload: tok/s, s/request, same answers as `reference`}} over every round."""
    out: dict = {}
    for side, rounds in results.items():
        for workload in WORKLOADS:
            rows = [row for r in rounds for row in r["rows"][workload] if "error" not in row]
            decode_tokens = sum(r["tokens"] - 1 for r in rows)
            decode_s = sum(r["seconds"] - r["first_s"] for r in rows)
            entry = {
                "requests": len(rows),
                "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
                "tok_s": sum(r["tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9),
                "ttft_s": statistics.median(r["first_s"] for r in rows) if rows else 0.0,
                "mean_tokens": sum(r["tokens"] for r in rows) / max(len(rows), 1),
            }
            if reference in results and side != reference and side.startswith("ours"):
                ref = [row["text"] for r in results[reference] for row in r["rows"][workload]]
                got = [row.get("text") for r in rounds for row in r["rows"][workload]]
                entry["same_as_reference"] = sum(a == b for a, b in zip(ref, got))
            out.setdefault(side, {})[workload] = entry
    return out


def markdown(res: dict) -> str:
    sides = res["summary"]
    lines = [
        f"{res['date']}, {res['cpu']}, git {res['git']}, model {res['model']}, {res['rounds']} rounds, "
        f"max_tokens {res['max_tokens']}: `{res['command']}`",
        "",
        "| side | "
        + " | ".join(f"{w}: decode tok/s" for w in WORKLOADS)
        + " | TTFT p50 ms (copy / edit / chat) | drafts kept / made |",
        "|---|" + "---:|" * (len(WORKLOADS) + 2),
    ]
    base = sides.get("ours, no drafts", {})
    for side, workloads in sides.items():
        cells = []
        for w in WORKLOADS:
            cell = f"{workloads[w]['decode_tok_s']:.1f}"
            if base and side != "ours, no drafts" and base[w]["decode_tok_s"]:
                cell += f" ({workloads[w]['decode_tok_s'] / base[w]['decode_tok_s']:.2f}x)"
            if "same_as_reference" in workloads[w]:
                cell += f", same text {workloads[w]['same_as_reference']}/{workloads[w]['requests']}"
            cells.append(cell)
        ttft = " / ".join(f"{workloads[w]['ttft_s'] * 1000:.0f}" for w in WORKLOADS)
        drafts = res["drafts"].get(side)
        kept = f"{drafts['kept']:.0f} / {drafts['drafted']:.0f}" if drafts and drafts.get("drafted") else "-"
        lines.append(f"| {side} | " + " | ".join(cells) + f" | {ttft} | {kept} |")
    mean = {w: next(iter(sides.values()))[w]["mean_tokens"] for w in WORKLOADS} if sides else {}
    lines += [
        "",
        "Decode tok/s: output tokens after the first / seconds from the first content to the end of "
        "the stream, over all requests of the workload; ratios in brackets: the side over "
        "`ours, no drafts`. Mean output tokens per request (first side): "
        + ", ".join(f"{w} {n:.0f}" for w, n in mean.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "results"))
    args = p.parse_args(argv)
    from common.model_files import default_model_path

    model = pathlib.Path(args.model) if args.model else default_model_path()
    ours_model = model if args.model else None
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-spec-"))
    makers = {
        "ours, no drafts": lambda: _Ours("ours, no drafts", ours_model, args.threads, log_dir, 0),
        "ours, drafts (default)": lambda: _Ours(
            "ours, drafts (default)", ours_model, args.threads, log_dir, None
        ),
    }
    if not args.skip_llamacpp:
        makers["llama.cpp"] = lambda: _Llama("llama.cpp", model, args.threads, ())
        makers["llama.cpp, ngram-simple"] = lambda: _Llama(
            "llama.cpp, ngram-simple", model, args.threads, ("--spec-type", "ngram-simple")
        )
        # its lookup and draft lengths set to ours (3 and 4), for a like-for-like draft
        makers["llama.cpp, ngram-simple n3 m4"] = lambda: _Llama(
            "llama.cpp, ngram-simple n3 m4",
            model,
            args.threads,
            (
                "--spec-type",
                "ngram-simple",
                "--spec-ngram-simple-size-n",
                "3",
                "--spec-ngram-simple-size-m",
                "4",
            ),
        )
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu(),
        "git": git_short(),
        "model": model.name,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "command": "python -m benchmarks.speculative " + " ".join(argv or []),
        "commands": {},
        "errors": {},
        "raw": {},
        "drafts": {},
    }

    def measure_side(name: str, side, rnd: int) -> None:
        result = run_side(side, args.max_tokens)
        res["raw"].setdefault(name, []).append(result)
        drafts = res["drafts"].setdefault(name, {})
        for key, value in result["drafts"].items():
            drafts[key] = drafts.get(key, 0.0) + value
        tokens = {w: sum(r.get("tokens", 0) for r in rows) for w, rows in result["rows"].items()}
        print(name, "round", rnd, tokens, flush=True)

    run_rounds(makers, args.rounds, measure_side, res)
    res["summary"] = summarize(res["raw"], "ours, no drafts")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(res, indent=2))
    table = markdown(res)
    (out / "speculative.md").write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
