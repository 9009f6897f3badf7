"""`python -m worker [--port N] [--model PATH] [engine flags]` serves one engine over gRPC.

Contract: every flag comes from the field metadata of `WorkerServerConfig` and `EngineConfig`
(common.config_cli), and each can also be set as an `LLM_*` variable (`--help` names it); a bad
value or a refused config (e.g. a public bind without mutual TLS) is a usage error, exit 2.
SIGTERM/SIGINT end the process with exit 0 once the interpreter's own start (~20 ms) is over:
while it serves they drain (worker.server); before, the handler installed first thing here records
them, and start-up stops at its next step without serving. A step under way (the model load, a
download) finishes first: it runs on a thread of its own, which nothing can stop safely.
Proven by tests/test_early_signals.py.
"""

# ruff: noqa: E402 - the stop recorder is installed before the other imports
from __future__ import annotations

from common import early_stop

if __name__ == "__main__":  # the process's entry only: a module that imports this keeps its handlers
    early_stop.install()

import argparse
import asyncio
import gc
import pathlib
import sys

from common.config_cli import Flags, new_parser, parse_or_exit
from common.logs import setup_logging
from worker.server_config import WorkerServerConfig


def parser() -> tuple[argparse.ArgumentParser, Flags]:
    p = new_parser("python -m worker", "LLM worker (gRPC)")
    return p, Flags(p, WorkerServerConfig, title="worker server")


def parse_args(argv: list[str] | None = None) -> WorkerServerConfig:
    p, flags = parser()

    def build(ns: argparse.Namespace) -> WorkerServerConfig:
        config = flags.build(ns)
        if config.engine.tensor_parallel_size > 1:  # a size the model cannot split: a usage error
            from worker.tp.shard import check_size, read_model_config

            check_size(read_model_config(config.engine.model), config.engine.tensor_parallel_size)
        for entry in config.engine.lora_modules:  # before loading anything (worker/lora.py reads them)
            name, sep, path = entry.partition("=")
            if not (
                sep
                and name.strip()
                and (pathlib.Path(path.strip()).expanduser() / "adapter_config.json").is_file()
            ):
                raise ValueError(
                    f"--lora-modules {entry!r}: expected NAME=PATH, PATH a PEFT adapter directory"
                )
        lora_dir = config.engine.lora_dir
        if lora_dir and not pathlib.Path(lora_dir).expanduser().is_dir():
            raise ValueError(f"--lora-dir {lora_dir!r}: not a directory")
        return config

    return parse_or_exit(p, argv, build)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("worker", config.telemetry.log_format)
    if early_stop.requested("worker"):
        return 0
    from worker.server import serve  # torch and the engine load only once the flags are good

    if early_stop.requested("worker"):
        return 0
    return asyncio.run(serve(config, stop_requested=lambda: bool(early_stop.SIGNALS)))


if __name__ == "__main__":
    status = main()
    # Served and stopped: the interpreter's final collection would walk every object torch and the model
    # allocated (measured 1.3 s of a worker's 2.5 s stop, 0.2 s of a router's); frozen, it skips them.
    gc.freeze()
    sys.exit(status)
