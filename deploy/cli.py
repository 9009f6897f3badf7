"""`llm-serve SUBCOMMAND [flags]`: one command in front of the existing entry points, `vllm serve`
style (installed as a console script by `pip install -e .`; `python -m deploy.cli` without one).

Contract
- `llm-serve serve` = `python -m deploy.local` (`make serve`: Ray, worker actors, router);
  `router` = `python -m router`; `worker` = `python -m worker`; `generate` = `python -m
  devtools.client`; `loadtest` = `python -m loadtest`; `launch` = `python -m deploy.ray_launch`
  (workers in a Ray cluster); `bench NAME` = `python -m benchmarks.NAME`.
- The rest of the command line goes to that module unchanged (so `llm-serve worker --help` is the
  worker's help and every flag and LLM_* variable works as documented there); the module runs as
  `__main__` in this process, and its SystemExit (status or message) is this command's.
- failure modes: an unknown subcommand or benchmark -> usage error (exit 2) listing the choices.
- The Makefile keeps calling `python -m ...`, so no `make` target needs the package installed.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

COMMANDS = {
    "serve": ("deploy.local", "local Ray + worker actors + router on 127.0.0.1:50051 (make serve)"),
    "router": ("router", "the router alone (--workers HOST:PORT,... or --ray-address ADDR)"),
    "worker": ("worker", "one worker: an engine behind gRPC"),
    "generate": ("devtools.client", "send a prompt or a chat to a router and stream the answer"),
    "loadtest": ("loadtest", "load test a router (or a local stack)"),
    "launch": ("deploy.ray_launch", "start or stop worker actors in a Ray cluster"),
    "bench": ("benchmarks.NAME", "run a benchmark: llm-serve bench NAME [flags]"),
}
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return (
        "usage: llm-serve SUBCOMMAND [flags]   (llm-serve SUBCOMMAND --help for its flags)\n\n"
        "subcommands:\n" + "\n".join(lines) + f"\n\nbenchmarks: {', '.join(benchmark_names())}\n"
    )


def resolve(argv: list[str]) -> tuple[str, list[str], str]:
    """(module, its argv, its program name) for `llm-serve` arguments; SystemExit(2) if unknown."""
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(usage())
        if argv and argv[0] not in ("-h", "--help"):
            sys.stderr.write(f"llm-serve: error: unknown subcommand {argv[0]!r}\n")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    if name == "bench":
        if not rest or rest[0] not in benchmark_names():
            sys.stderr.write(
                f"usage: llm-serve bench NAME [flags]\nbenchmarks: {', '.join(benchmark_names())}\n"
            )
            raise SystemExit(0 if rest[:1] in (["-h"], ["--help"]) else 2)
        return f"benchmarks.{rest[0]}", rest[1:], f"llm-serve bench {rest[0]}"
    return COMMANDS[name][0], rest, f"llm-serve {name}"


def main(argv: list[str] | None = None) -> int:
    module, rest, prog = resolve(sys.argv[1:] if argv is None else argv)
    sys.argv = [prog, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # most end in sys.exit(main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
