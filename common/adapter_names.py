"""What a LoRA adapter may be named (a model id to clients): checked by the router before it asks
a worker (router/lora_admin.py) and by the worker itself (worker/lora_files.py)."""

from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")


def name_problem(name: str) -> str:
    """ "" for a good name, else why not (the name shortened to 128 characters)."""
    if NAME.fullmatch(name):
        return ""
    return f"adapter name {name[:128]!r}: 1-128 of A-Z a-z 0-9 . _ : @ + / -, first a letter or digit"
