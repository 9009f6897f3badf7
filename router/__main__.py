"""`python -m router --workers host:port,... | --ray-address ADDR` serves the router (see --help).

Contract: the flags and their `LLM_*` variables come from `RouterConfig`'s field metadata
(router.config.parse_args); a bad value is a usage error (exit 2); SIGTERM drains, exit 0.
A SIGTERM/SIGINT during start-up (after the interpreter's own first ~20 ms) also ends it with
exit 0, without serving: the handler installed first thing here records it until router.server
installs its own, which stops start-up once the model table (tokenizers) is loaded.
Proven by tests/test_early_signals.py.
"""

# ruff: noqa: E402 - the stop recorder is installed before the other imports
from common import early_stop

if __name__ == "__main__":  # the process's entry only: a module that imports this keeps its handlers
    early_stop.install()

import asyncio
import gc
import sys

from common.logs import setup_logging
from router.config import parse_args


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("router", config.telemetry.log_format)
    if early_stop.requested("router"):
        return 0
    from router.server import serve  # grpc and the tokenizer load only once the flags are good

    if early_stop.requested("router"):
        return 0
    return asyncio.run(serve(config, stop_requested=lambda: bool(early_stop.SIGNALS)))


if __name__ == "__main__":
    status = main()
    # Served and stopped: the interpreter's final collection would walk every object grpc and the tokenizer
    # allocated (measured 1.3 s of a worker's 2.5 s stop, 0.2 s of a router's); frozen, it skips them.
    gc.freeze()
    sys.exit(status)
