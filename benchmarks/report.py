"""What every benchmark writes beside its numbers: the git revision it measured, and its own
section of a Markdown file (docs/benchmarks.md), replaced in place.

- `git_short()` -> the short HEAD commit, "+dirty" when tracked files differ from it; "unknown"
  outside a git checkout (the GPU machine gets a copy of the tree without .git).
- `replace_section(text, title, body)` -> `text` with the level-2 section `## title` (up to the
  next level-2 heading outside a code fence) replaced by `body`, or `body` appended when there is
  none; `write_section(path, title, body)` does that to a file (created when missing) atomically.
Standard library only: benchmarks that run on the GPU machine import it.
"""

from __future__ import annotations

import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_short() -> str:
    commit = _git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def replace_section(text: str, title: str, body: str) -> str:
    body = body.rstrip("\n") + "\n"
    lines = text.splitlines(keepends=True)
    heading = f"## {title}"
    in_fence = False
    start = end = None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if start is None and line.rstrip("\n").rstrip() == heading:
            start = i
        elif start is not None and line.startswith("## "):
            end = i
            break
    if start is None:
        prefix = text.rstrip("\n")
        return (prefix + "\n\n" if prefix else "") + body
    end = len(lines) if end is None else end
    after = "".join(lines[end:])
    return "".join(lines[:start]) + body + ("\n" + after if after else "")


def write_section(path: pathlib.Path, title: str, body: str) -> None:
    text = (
        path.read_text(encoding="utf-8")
        if path.exists()
        else (
            "# Benchmarks\n\nGenerated sections: each is rewritten by the command it names and only by it.\n"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(replace_section(text, title, body), encoding="utf-8")
    tmp.replace(path)
