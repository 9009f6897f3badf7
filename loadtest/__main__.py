"""`python -m loadtest` (see `python -m loadtest --help` and loadtest/cli.py)."""

import sys

from loadtest.cli import main

sys.exit(main())
