"""What a LoRA adapter may be named (a model id to clients): checked by the router before it asks
a worker (router/lora_admin.py, router/lora_autoload.py) and by the worker itself
(worker/lora_files.py).

Contract
- input: a name as a client or an admin spelled it.
- output: `name_problem(name)`: "" for a good name, else why not. A good name is 1-128 of
  A-Z a-z 0-9 . _ : @ + / -, first a letter or digit, and canonical: its `/`-separated segments are
  none empty (`sql//x`, a trailing `/`), none `.` and none `..`. So one spelling names one path under
  --lora-dir: `sql/`, `sql/.`, `sql//`, `x/../sql` are refused, never a second adapter of `sql`'s
  directory (the spelling's `posixpath.normpath`, when good, is named in the refusal as the one to
  use). `spelling_problem(name)`: the canonical-form part alone ("" for a name of other characters).
- proven by: tests/test_adapter_names.py.
"""

from __future__ import annotations

import posixpath
import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")


def spelling_problem(name: str) -> str:
    """ "" when `name`'s path segments are canonical (none empty, `.` or `..`), else why not."""
    segments = name.split("/")
    if segments[-1] == "" and len(segments) > 1:
        why = "a trailing '/'"
    elif "" in segments:
        why = "an empty path segment ('//')"
    elif ".." in segments:
        why = "a '..' path segment"
    elif "." in segments:
        why = "a '.' path segment"
    else:
        return ""
    shown = name[:128]
    hint = posixpath.normpath(shown)
    use = f"; use {hint!r}" if hint != shown and NAME.fullmatch(hint) and not _odd(hint) else ""
    return f"adapter name {shown!r} is not canonical: {why}{use}"


def _odd(name: str) -> bool:
    return any(s in ("", ".", "..") for s in name.split("/"))


def name_problem(name: str) -> str:
    """ "" for a good name, else why not (the name shortened to 128 characters)."""
    if not NAME.fullmatch(name):
        return f"adapter name {name[:128]!r}: 1-128 of A-Z a-z 0-9 . _ : @ + / -, first a letter or digit"
    return spelling_problem(name)
