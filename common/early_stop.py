"""A SIGTERM/SIGINT that arrives while a process starts, recorded until its server installs its own
handlers (`python -m router` and `python -m worker` install this first thing).

Contract
- `install()`: SIGINT and SIGTERM are appended to `SIGNALS` instead of acting. SIGTERM goes in
  last: once its handler is in, both are (tests/test_early_signals.py waits on that). Recorded,
  not raised: a KeyboardInterrupt would leave a model load's thread (and any tensor-parallel ranks)
  running with nobody to stop them, and the interpreter waits for that thread anyway.
- `requested(logger_name)`: whether one arrived; if so, says so in that logger.
- state: `SIGNALS`, for the life of the process. Imports nothing heavy (it runs before torch).
- proven by: tests/test_early_signals.py (real router and worker processes).
"""

import logging
import signal

SIGNALS: list[int] = []


def _record(signum: int, frame) -> None:
    SIGNALS.append(signum)


def install() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _record)


def requested(logger_name: str) -> bool:
    if SIGNALS:
        logging.getLogger(logger_name).info(
            "%s during start-up: not serving", signal.Signals(SIGNALS[0]).name
        )
    return bool(SIGNALS)
