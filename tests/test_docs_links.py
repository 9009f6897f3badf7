"""Every file path the documentation names exists (issue 46: run outputs moved to docs/data/).

Files moved under docs/ (run outputs to docs/data/, a section of docs/benchmarks.md to
docs/benchmarks-history.md) leave dead links behind unless something checks them. This test reads
README.md and every Markdown file under docs/ (docs/data/'s generated reports included: they
embed their plots) and checks three kinds of reference, each resolved without a network:

- Markdown links and images, `[text](path)` / `![alt](path)`: the path, relative to the file that
  holds the link, names an existing file or directory. The `#fragment` is ignored; absolute URLs
  (`https:`, `mailto:`) and fragment-only links (`#section`) are not checked.
- Backticked repository paths, `` `docs/data/gpu/x.json` `` or `` `benchmarks/soak.py` ``: a span
  without spaces that starts with one of the repository's top-level directories (REPO_DIRS) and
  ends in a file suffix (or a "/"), relative to the repository root. Spans with a placeholder or a
  pattern (`<scenario>`, `*`, `{a,b}`, `$OUT`) are a description, not a path, and are skipped; so
  is a trailing `:line` or `::test`.
- The same paths written in the prose without backticks (`docs/gpu/hot-path.md`), found by the same
  rule.

results/ is not in REPO_DIRS: it is git-ignored, and the docs name its files as "not committed".
NOT_YET_WRITTEN lists outputs a doc names as what a command writes before the run that writes them
is committed, each with the reason; an entry there is skipped, nothing else is.

Contract:
- input: the working tree (README.md, docs/**/*.md); nothing is imported or run.
- output: one test per Markdown file; a failure lists each dead reference as "kind: path".
- failure modes: a moved or deleted file that a doc still names; a link written relative to the
  wrong directory (a doc under docs/ that links its sibling with a docs/ prefix).
- proven by: test_checker_finds_each_kind_of_dead_reference (a scratch doc with dead and live
  references of each kind), and by hand on the tree of the commit that moved the run outputs
  before their references were updated: README.md, docs/benchmarks.md, docs/gpu/hot-path.md and
  docs/reliability.md failed, naming each old path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPO_DIRS = (
    ".ci",
    "benchmarks",
    "common",
    "deploy",
    "devtools",
    "docs",
    "fuzz",
    "loadtest",
    "protos",
    "router",
    "tests",
    "worker",
)
NOT_YET_WRITTEN: dict[str, str] = {}
SUFFIXES = "cpp|gguf|h|ini|json|jsonl|log|md|png|proto|py|sh|svg|toml|txt|yaml|yml|cfg|csv|html|lock|in"

_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_TICK = re.compile(r"`([^`\s]+)`")
_DIRS = "|".join(re.escape(d) for d in REPO_DIRS)
_REPO_PATH = re.compile(rf"(?:{_DIRS})/(?:[\w.-]+/)*(?:[\w.-]*\.(?:{SUFFIXES})|)$")
_BARE = re.compile(rf"(?<![\w/.`<$*{{-])((?:{_DIRS})/(?:[\w.-]+/)*[\w-][\w.-]*\.(?:{SUFFIXES}))(?![\w/*<{{])")
_PATTERN = re.compile(r"[*<>{}$|()\[\],]")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _repo_path(span: str) -> str | None:
    """A backticked span -> the repository path it names, or None when it names none."""
    span = span.rstrip(".;")
    span = re.sub(r"(::[\w\[\]-]+|:\d+(-\d+)?)$", "", span)  # tests/x.py::test_a, x.py:12
    if _PATTERN.search(span) or not _REPO_PATH.match(span):
        return None
    return span


def dead_references(doc: Path, root: Path = ROOT) -> list[str]:
    """Every path `doc` names that does not exist, as "link: ...", "backticks: ..." or "prose: ..."."""
    text = doc.read_text(encoding="utf-8")
    dead = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[A-Za-z][\w+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            dead.append(f"link: {target}")
    named = set()
    for m in _TICK.finditer(text):
        path = _repo_path(m.group(1))
        if path is not None:
            named.add(path)
            if path not in NOT_YET_WRITTEN and not (root / path).exists():
                dead.append(f"backticks: {path}")
    prose = _TICK.sub(" ", _LINK.sub(" ", text))
    for m in _BARE.finditer(prose):
        path = m.group(1)
        if path not in named and path not in NOT_YET_WRITTEN and not (root / path).exists():
            named.add(path)
            dead.append(f"prose: {path}")
    return sorted(set(dead))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    dead = dead_references(doc)
    assert not dead, f"{doc.relative_to(ROOT)} names files that do not exist:\n" + "\n".join(dead)


def test_checker_finds_each_kind_of_dead_reference(tmp_path):
    (tmp_path / "docs" / "data").mkdir(parents=True)
    (tmp_path / "docs" / "data" / "run.json").write_text("{}")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "soak.py").write_text("")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "Live: [other](other.md#other), ![plot](data/run.json), [dir](data/), [web](https://x.org/a.md),\n"
        "[here](#top), `benchmarks/soak.py`, `benchmarks/soak.py:12`, `docs/data/run.json`,\n"
        "`docs/data/<scenario>.json`, `docs/data/*.json`, `docs/{a,b}.json`, `results/x.json`,\n"
        "benchmarks/soak.py in prose.\n"
        "Dead: [gone](gone.md#x), ![plot](reliability/run.json), `benchmarks/gone.py`,\n"
        "`docs/reliability/run.json`, docs/gpu/hot-path.md in prose.\n"
    )
    assert dead_references(doc, tmp_path) == [
        "backticks: benchmarks/gone.py",
        "backticks: docs/reliability/run.json",
        "link: gone.md#x",
        "link: reliability/run.json",
        "prose: docs/gpu/hot-path.md",
    ]
