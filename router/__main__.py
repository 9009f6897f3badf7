"""`python -m router --workers host:port,...` (see `python -m router --help`)."""
import asyncio
import sys

from common.logs import setup_logging
from router.config import parse_args
from router.server import serve


def main() -> int:
    try:
        config = parse_args()
    except ValueError as exc:  # a bad flag value or unreadable TLS file: a usage error, not a traceback
        raise SystemExit(f"python -m router: error: {exc}") from None
    setup_logging("router", config.telemetry.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
