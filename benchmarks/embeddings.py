"""Embeddings side by side: POST /v1/embeddings on our stack and on llama.cpp's llama-server
(`--embeddings --pooling last|mean`), same GGUF, same texts, same pooling.

Contract
- input: `--model` (GGUF; the embedded SmolLM2 by default), `--threads`, `--texts` (96), `--batch`
  (16 inputs per request), `--rounds` (2: every side runs once per round, the order reversed in
  the second, so drift on a shared machine falls on both), `--seed` (0), `--skip-llamacpp`;
  llama-server built once as for `make bench-serve` (benchmarks/llamacpp.py), with `--parallel`
  equal to the batch (it computes a request's inputs in that many slots; ours runs 16 at once).
- protocol: TEXTS word windows of 8 to 120 words cut from PARAGRAPHS at seeded random places; a
  side is started alone, sent one unmeasured request, then (1) every text in requests of `--batch`
  inputs, one request at a time, (2) the first 16 texts again, one per request (each vector
  compared with the same text's from (1): a server's vector should not depend on the batch it
  came in), and (3) 16 texts no side has seen (prefixed with the side, so no prefix cache helps),
  one per request: the latency of a single query; encoding_format float, each vector
  L2-normalized by the server.
- output: per side and pooling: inputs/s and prompt tokens/s of (1) (usage.prompt_tokens), the
  median latency of (3), the lowest cosine of (2), and the agreement of our vectors with
  llama.cpp's (cosine per text: mean and minimum): two implementations of one model, so a wrong
  pooling, norm or position shows as a low cosine. A JSON file and a markdown table in results/
  (docs/benchmarks.md, "Embeddings side by side"), the CPU model and git revision with it.
- failure modes: a side that fails to start is reported with its log tail and the others still
  run; a failed request raises (an embedding run has no partial result worth a rate).
- proven by: tests/test_pooling.py and tests/test_openai_embeddings_e2e.py (the vectors against
  transformers and through the API); the servers only run here.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import tempfile
import time
import urllib.request

from benchmarks.report import REPO, git_short
from benchmarks.serve_sides import LlamaHttpSide, OurHttpSide, run_rounds
from benchmarks.speculative import PARAGRAPHS, QUESTIONS
from benchmarks.structured_output import _cpu

POOLINGS = ("last", "mean")
SINGLES = 16


def make_texts(n: int, seed: int) -> list[str]:
    words = " ".join(PARAGRAPHS + QUESTIONS).split()
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = rng.randint(8, 120)
        start = rng.randrange(len(words))
        texts.append(" ".join(words[(start + k) % len(words)] for k in range(length)))
    return texts


def embed(url: str, inputs: list[str], pooling: str, timeout_s: float = 600.0) -> tuple[list, int, float]:
    """One POST /v1/embeddings: (vectors in input order, usage.prompt_tokens, seconds)."""
    body = {"model": "", "input": inputs, "encoding_format": "float", "pooling": pooling}
    request = urllib.request.Request(
        url + "/v1/embeddings", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        answer = json.loads(reply.read())
    seconds = time.perf_counter() - start
    vectors = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
    if len(vectors) != len(inputs):
        raise ValueError(f"{len(vectors)} embeddings for {len(inputs)} inputs")
    return vectors, answer["usage"]["prompt_tokens"], seconds


def measure(url: str, texts: list[str], fresh: list[str], pooling: str, batch: int) -> dict:
    """`texts` in batches, then the first SINGLES of them alone (the same vectors?), then `fresh`
    texts alone (the latency of a query no cache has seen)."""
    embed(url, texts[:2], pooling)  # unmeasured: first-request costs
    vectors, tokens, seconds = [], 0, 0.0
    for k in range(0, len(texts), batch):
        got, n, s = embed(url, texts[k : k + batch], pooling)
        vectors += got
        tokens, seconds = tokens + n, seconds + s
    singles = [embed(url, [text], pooling) for text in texts[:SINGLES]]
    latency = [embed(url, [text], pooling)[2] for text in fresh]
    return {
        "inputs_per_s": len(texts) / seconds,
        "tokens_per_s": tokens / seconds,
        "prompt_tokens": tokens,
        "single_ms_p50": statistics.median(latency) * 1000,
        "dim": len(vectors[0]),
        # the same text alone and in a batch: a server's vectors should not depend on the company
        "alone_vs_batch_min": min(cosine(v, got[0]) for v, (got, _, _) in zip(vectors, singles)),
        "vectors": vectors,
    }


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b)))


class _Ours(OurHttpSide):
    poolings = POOLINGS  # chosen per request


class _Llama(LlamaHttpSide):
    def __init__(self, model: pathlib.Path, threads: int, pooling: str, batch: int):
        extra = ("--embeddings", "--pooling", pooling)
        super().__init__(model, threads, parallel=batch, ctx_size=512 * batch, extra=extra)
        self.poolings = (pooling,)


def summarize(raw: dict) -> dict:
    """{side: {pooling: means over rounds}}, with each llama.cpp side's cosine to ours."""
    out: dict = {}
    for side, rounds in raw.items():
        pooling = side.rsplit(" ", 1)[-1]
        runs = rounds
        out[side] = {
            key: statistics.mean(r[key] for r in runs)
            for key in ("inputs_per_s", "tokens_per_s", "single_ms_p50", "prompt_tokens")
        }
        out[side]["dim"] = runs[0]["dim"]
        out[side]["alone_vs_batch_min"] = min(r["alone_vs_batch_min"] for r in runs)
        ours = raw.get(f"ours {pooling}")
        if ours and not side.startswith("ours"):
            cosines = [cosine(a, b) for a, b in zip(ours[0]["vectors"], runs[0]["vectors"])]
            out[side]["cosine_mean"] = statistics.mean(cosines)
            out[side]["cosine_min"] = min(cosines)
    return out


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [
        f"{res['date']}, {res['cpu']}, git {res['git']}, model {res['model']}, {res['texts']} texts "
        f"(8-120 words, seed {res['seed']}) in requests of {res['batch']}, {res['rounds']} rounds: "
        f"`{res['command']}`",
        "",
        "| side | pooling | inputs/s | prompt tok/s | one text, p50 ms | x llama.cpp (inputs/s) "
        "| cosine to ours (mean / min) | alone vs in a batch (min cosine) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side, row in s.items():
        name, pooling = side.rsplit(" ", 1)
        peer = s.get(f"llama.cpp {pooling}")
        ratio = f"{row['inputs_per_s'] / peer['inputs_per_s']:.2f}x" if peer else "-"
        cos = f"{row['cosine_mean']:.4f} / {row['cosine_min']:.4f}" if "cosine_mean" in row else "-"
        lines.append(
            f"| {name} | {pooling} | {row['inputs_per_s']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['single_ms_p50']:.0f} | {ratio if name == 'ours' else '1.00x'} | {cos} | "
            f"{row['alone_vs_batch_min']:.4f} |"
        )
    tokens = ", ".join(f"{side} {row['prompt_tokens']:.0f}" for side, row in s.items())
    dims = sorted({row["dim"] for row in s.values()})
    lines += ["", f"Prompt tokens per pass as each server counted them: {tokens}; vectors of {dims} floats."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--texts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "results"))
    args = p.parse_args(argv)
    from common.model_files import default_model_path

    model = pathlib.Path(args.model) if args.model else default_model_path()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-embed-"))
    texts = make_texts(args.texts, args.seed)
    makers = {"ours": lambda: _Ours(model if args.model else None, args.threads, log_dir)}
    if not args.skip_llamacpp:
        for pooling in POOLINGS:
            makers[f"llama.cpp {pooling}"] = lambda p=pooling: _Llama(model, args.threads, p, args.batch)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu(),
        "git": git_short(),
        "model": model.name,
        "texts": args.texts,
        "batch": args.batch,
        "rounds": args.rounds,
        "seed": args.seed,
        "command": "python -m benchmarks.embeddings " + " ".join(argv or []),
        "commands": {},
        "errors": {},
        "raw": {},
    }

    def measure_side(name: str, side, rnd: int) -> None:
        url = side.start()
        try:
            for pooling in side.poolings:
                key = f"{name.split(' ')[0]} {pooling}"
                # fresh texts per side, round and pooling: no prefix cache has seen them
                fresh = make_texts(SINGLES, args.seed + 1 + len(res["raw"].get(key, ())))
                fresh = [f"{key} {k}: {t}" for k, t in enumerate(fresh)]
                result = measure(url, texts, fresh, pooling, args.batch)
                res["raw"].setdefault(key, []).append(result)
                print(key, "round", rnd, f"{result['inputs_per_s']:.1f} inputs/s", flush=True)
        finally:
            side.stop()

    run_rounds(makers, args.rounds, measure_side, res)
    res["summary"] = summarize(res["raw"])
    for rounds in res["raw"].values():  # the vectors are for the cosines, not for the file
        for r in rounds:
            r.pop("vectors")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps(res, indent=2))
    table = markdown(res)
    (out / "embeddings.md").write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
