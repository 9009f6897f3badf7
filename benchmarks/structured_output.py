"""What structured output costs per engine step: the same greedy chat requests with and without
`{"type": "json_object"}`, taking turns in one process on one model runner (the default CPU path).

Contract
- input: `--batches` (rows per step), `--tokens` (max tokens per request), `--rounds` (alternating
  pairs); the embedded SmolLM2 unless `--model`.
- output: per batch size the median decode-step time free vs constrained (ms) and the added time
  per constrained row; one line per round, then a markdown table (docs/benchmarks.md).
- failure modes: none of its own (engine errors propagate).
- proven by: tests/test_structured_output.py runs it at its smallest size.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def step_ms(runner, config, prompt: list[int], params, rows: int) -> float:
    """Median step time (ms) of `rows` copies of one request, first two steps (prefill) left out."""
    from worker.engine import LLMEngine

    engine = LLMEngine(config, runner=runner)
    for i in range(rows):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[2:] or steps) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.structured_output", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batches", default="1,8,32", help="rows per step, comma-separated")
    p.add_argument("--tokens", type=int, default=40, help="max tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="alternating free/constrained pairs per batch")
    p.add_argument("--model", default=None, help="GGUF file or model directory (default: embedded SmolLM2)")
    args = p.parse_args(argv)

    from common.model_files import default_model_path
    from common.structured import grammar_for
    from common.tokenizer import Tokenizer
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner
    from worker.types import SamplingParams

    config = EngineConfig(model=args.model, kv_cache_bytes=256 * 2**20)
    runner = ModelRunner(config)
    prompt = Tokenizer.from_model(args.model or default_model_path()).encode_chat(
        [{"role": "user", "content": "Describe a person as JSON."}]
    )
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    constrained = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, grammar=grammar_for({"type": "json_object"})
    )
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        pairs = []
        for r in range(args.rounds):
            pair = (
                step_ms(runner, config, prompt, free, batch),
                step_ms(runner, config, prompt, constrained, batch),
            )
            pairs.append(pair)
            print(f"batch {batch} round {r}: free {pair[0]:.2f} ms, json_object {pair[1]:.2f} ms", flush=True)
        f, c = statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
        rows.append({"batch": batch, "free_ms": f, "constrained_ms": c, "per_row_ms": (c - f) / batch})
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_cpu()}, {runner.model_name}")
    print("| batch | free step ms | json_object step ms | added per constrained row ms |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        cells = (f"{row['free_ms']:.2f}", f"{row['constrained_ms']:.2f}", f"{row['per_row_ms']:.3f}")
        print(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
