"""Tool calling, side by side: the same requests with tools to our stack's OpenAI API and to
llama.cpp's llama-server on the same GGUF, scored for what an agent needs from the answer.

Contract
- input: `--model` (GGUF; the embedded SmolLM2 by default), `--threads`, `--modes` (tool_choice
  values: required, auto), `--skip-llamacpp`; llama-server built once as for `make bench-serve`
  (benchmarks/llamacpp.py).
- protocol: CASES (a question, the function it calls for, an argument that must carry a value)
  with all four TOOLS offered, greedy (temperature 0), max_tokens 96, one request at a time,
  `parallel_tool_calls: false`; each side started alone (ours: worker + router with its HTTP
  front, default flags), asked every case in every mode, stopped.
- output: per side and mode: answers with a tool call, calls that are valid (a listed function,
  arguments an instance of its schema), the right function, the right argument value (the
  expected text inside the argument, case-insensitive), median latency; a JSON file and a markdown
  table in results/ (docs/benchmarks.md, "Tool calling"), the CPU model and git revision with it.
- failure modes: a side that fails to start is reported with its log tail and the other still
  runs; a request that fails counts as no call (its error kept in the JSON).
- proven by: tests/test_tool_answers.py (`score` on hand-made answers); the servers only run here.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.report import REPO, git_short
from benchmarks.serve_sides import LlamaHttpSide, OurHttpSide
from benchmarks.structured_output import _cpu


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    _tool("get_weather", "Current weather in a city.", {"city": {"type": "string"}}, ["city"]),
    _tool("get_time", "Current local time in a city.", {"city": {"type": "string"}}, ["city"]),
    _tool(
        "convert_currency",
        "Convert an amount of money between currencies.",
        {"amount": {"type": "number"}, "source": {"type": "string"}, "target": {"type": "string"}},
        ["amount", "source", "target"],
    ),
    _tool("web_search", "Search the web.", {"query": {"type": "string"}}, ["query"]),
]
CASES = [  # (question, function, argument, expected text in it)
    ("What is the weather in Paris?", "get_weather", "city", "paris"),
    ("Is it raining in London right now?", "get_weather", "city", "london"),
    ("How hot is it in Cairo today?", "get_weather", "city", "cairo"),
    ("What time is it in Tokyo?", "get_time", "city", "tokyo"),
    ("Tell me the current time in New York.", "get_time", "city", "new york"),
    ("What's the local time in Sydney?", "get_time", "city", "sydney"),
    ("Convert 100 US dollars to euros.", "convert_currency", "amount", "100"),
    ("How many yen is 50 euros?", "convert_currency", "amount", "50"),
    ("Change 20 pounds into dollars.", "convert_currency", "amount", "20"),
    ("Search the web for Rust tutorials.", "web_search", "query", "rust"),
    ("Find news about the Mars rover online.", "web_search", "query", "mars"),
    ("Look up recipes for banana bread.", "web_search", "query", "banana bread"),
]


def score(message: dict, function: str, argument: str, expected: str) -> dict:
    """One answer (an OpenAI chat `message`): did it call, validly, the right function with the
    right value?"""
    import jsonschema

    calls = message.get("tool_calls") or []
    out = {"called": bool(calls), "valid": False, "right_function": False, "right_argument": False}
    if not calls:
        return out
    first = calls[0].get("function") or {}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        arguments = json.loads(first.get("arguments") or "")
        jsonschema.validate(arguments, schemas[first.get("name")])
        out["valid"] = True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return out
    out["right_function"] = first["name"] == function
    out["right_argument"] = out["right_function"] and expected in str(arguments.get(argument, "")).lower()
    return out


def _post(url: str, body: dict, timeout_s: float = 300.0) -> dict:
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def ask_all(url: str, mode: str) -> list[dict]:
    rows = []
    for question, function, argument, expected in CASES:
        body = {
            "model": "",
            "messages": [{"role": "user", "content": question}],
            "tools": TOOLS,
            "tool_choice": mode,
            "parallel_tool_calls": False,
            "max_tokens": 96,
            "temperature": 0,
        }
        start = time.perf_counter()
        try:
            message = _post(url, body)["choices"][0]["message"]
            row = {"question": question, **score(message, function, argument, expected), "message": message}
        except (OSError, ValueError, KeyError, urllib.error.HTTPError) as exc:
            row = {"question": question, **score({}, function, argument, expected), "error": str(exc)[:300]}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    return rows


def _summary(rows: list[dict]) -> dict:
    return {
        "cases": len(rows),
        **{k: sum(r[k] for r in rows) for k in ("called", "valid", "right_function", "right_argument")},
        "median_s": statistics.median(r["seconds"] for r in rows),
    }


def markdown(res: dict) -> str:
    lines = [
        f"{res['date']}, {res['cpu']}, git {res['git']}, model {res['model']}: `{res['command']}`",
        "",
        "| side | tool_choice | with a call | valid calls | right function | right argument | median s |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, modes in res["sides"].items():
        if "error" in modes:
            lines.append(f"| {side} | - | failed to start: {modes['error'][:80]} | | | | |")
            continue
        for mode, s in modes.items():
            n = s["cases"]
            lines.append(
                f"| {side} | {mode} | {s['called']}/{n} | {s['valid']}/{n} | {s['right_function']}/{n} | "
                f"{s['right_argument']}/{n} | {s['median_s']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tool_calls", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="required,auto", help="tool_choice values, comma-separated")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "results"))
    args = p.parse_args(argv)
    from common.model_files import default_model_path

    model = pathlib.Path(args.model) if args.model else default_model_path()
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu(),
        "git": git_short(),
        "model": model.name,
        "command": "python -m benchmarks.tool_calls " + " ".join(argv or []),
        "sides": {},
        "rows": {},
    }
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-tools-"))
    sides = [lambda: OurHttpSide(None if not args.model else model, args.threads, log_dir)]
    if not args.skip_llamacpp:
        sides.append(lambda: LlamaHttpSide(model, args.threads, parallel=1, ctx_size=4096))
    for make in sides:
        side = None
        try:
            side = make()
            url = side.start()
        except Exception as exc:  # noqa: BLE001 - one side failing must not cost the other
            name = getattr(side, "name", "llama.cpp")
            res["sides"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{name} failed to start: {exc}", flush=True)
            if side is not None:
                side.stop()
            continue
        try:
            for mode in args.modes.split(","):
                rows = ask_all(url, mode)
                res["rows"].setdefault(side.name, {})[mode] = rows
                res["sides"].setdefault(side.name, {})[mode] = _summary(rows)
                print(side.name, mode, res["sides"][side.name][mode], flush=True)
        finally:
            side.stop()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tool_calls.json").write_text(json.dumps(res, indent=2))
    table = markdown(res)
    (out / "tool_calls.md").write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
