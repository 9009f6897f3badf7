"""Process logging: text (the default) or one JSON object per line, and the per-request line.

Contract
- `setup_logging(component, log_format)` configures the root logger once per process (`text`:
  `time component LEVEL message key=value ...`; `json`: `{"ts", "level", "component", "logger",
  "msg", ...fields}`).
- `log_request(logger, **fields)` writes the one line per finished request ("request finished")
  with its fields (request id, status, tokens, timings, trace_id); fields with value None are left
  out.
- state: the root logger's handler.
"""

from __future__ import annotations

import json
import logging
import time

FIELDS = "fields"  # LogRecord attribute carrying a dict of structured fields


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, FIELDS, None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


class _JsonFormatter(logging.Formatter):
    def __init__(self, component: str):
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "component": self._component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(getattr(record, FIELDS, None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(component: str, log_format: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(_JsonFormatter(component))
    else:
        handler.setFormatter(_TextFormatter(f"%(asctime)s {component} %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def log_request(logger: logging.Logger, **fields) -> None:
    logger.info("request finished", extra={FIELDS: {k: v for k, v in fields.items() if v is not None}})
