"""`python -m router --workers host:port,...` (see `python -m router --help`)."""
import asyncio
import logging
import sys

from router.config import parse_args
from router.server import serve


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    return asyncio.run(serve(parse_args()))


if __name__ == "__main__":
    sys.exit(main())
