"""Control-token text inside chat messages: which pieces of the messages could become a control
token once the chat template is rendered, and their replacement by sentinels (the tokenizer's
half: common/tokenizer.py `Tokenizer.encode_chat`).

Contract
- input: the contents of a vocabulary's control (special) tokens (`ControlTokenText(contents)`),
  then the messages and tools of one chat as common/chat_tools.py takes them.
- output: `protect(messages, tools) -> Protected | None`: None when no string in them could
  make a control token (the common case: nothing to do), else copies of messages and tools in
  which each risky fragment of a string is a sentinel (`OPEN + index + CLOSE`, two characters
  found in no string of the chat) and `restore(text)` that puts the fragments back. A fragment is
  risky when it is (1) a control token's full text anywhere in a string, (2) a string's first or
  last characters (after whitespace, which `| trim` drops) that are the tail or the head (2+
  characters) of a control token, which the text next to it in the prompt could complete (a name
  written right before a content), or (3) a whole string of 2+ characters inside a control token.
  Every string is looked at: contents, names, call ids, arguments, tool descriptions and
  parameters by all three rules; dict keys and the values of `role` and `type` keys by rule 1
  only (a role is a validated name a template compares and may build a token from: `'<|' + role
  + '|>'`). A 1-character half (a content ending in `<`) is left alone: the template would have
  to write the rest of the token right next to it.
- state: read-only after construction.
- failure modes: `ValueError` when every sentinel candidate character (31 of the Unicode
  noncharacters, U+FDEF being the tokenizer's, and the private use area) occurs in the chat.
- proven by: tests/test_control_tokens.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Sentinel characters: Unicode noncharacters first (reserved for internal use), then the private
# use area; the first two that no string of the chat holds open and close each sentinel.
_CANDIDATES = [chr(c) for c in range(0xFDD0, 0xFDEF)] + [chr(c) for c in range(0xE000, 0xF900)]
_NOT_TEXT_KEYS = frozenset({"role", "type"})


@dataclass(frozen=True)
class Protected:
    messages: list[dict]
    tools: list[dict]
    restore: Callable[[str], str]  # sentinels -> the fragments they stand for


def _trie_pattern(words: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `words`, leftmost-longest (as the tokenizer's added-token matcher):
    a trie, so each character picks at most one branch, with longer words tried first."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie))


class ControlTokenText:
    """Finds control-token text in the strings of a chat (see the module docstring)."""

    def __init__(self, contents: Iterable[str]) -> None:
        tokens = sorted({t for t in contents if t})
        self._pattern = _trie_pattern(tokens) if tokens else None
        self._longest = max(map(len, tokens), default=0)
        self._joined = "\x00".join(tokens)  # rule 3: a string inside one token
        self._heads = {t[:k] for t in tokens for k in range(2, len(t))}  # proper prefixes, 2+
        self._tails = {t[k:] for t in tokens for k in range(1, len(t) - 1)}  # proper suffixes, 2+

    def fragments(self, text: str, edges: bool = True) -> list[tuple[int, int]]:
        """The (start, end) spans of `text` to protect, sorted and disjoint (`edges`: rules 2 and 3
        too, else only full tokens)."""
        if self._pattern is None or not text:
            return []
        start = len(text) - len(text.lstrip())
        end = len(text.rstrip())
        if edges and 2 <= end - start <= self._longest and "\x00" not in text:
            if text[start:end] in self._joined:
                return [(start, end)]
        spans = [m.span() for m in self._pattern.finditer(text)]
        if not edges:
            return spans
        lo = spans[0][0] if spans else end  # a head fragment ends before the first full token
        heads = range(min(self._longest, lo - start), 1, -1)
        head = next((k for k in heads if text[start : start + k] in self._tails), 0)
        hi = max(spans[-1][1] if spans else 0, start + head)  # a tail one starts after both
        tails = range(min(self._longest, end - hi), 1, -1)
        tail = next((k for k in tails if text[end - k : end] in self._heads), 0)
        if head:
            spans.insert(0, (start, start + head))
        if tail:
            spans.append((end - tail, end))
        return spans

    def protect(self, messages: list[dict], tools: list[dict]) -> Protected | None:
        """Messages and tools with their risky fragments as sentinels, or None when none is."""
        if self._pattern is None:
            return None
        strings = list(_strings((messages, tools)))
        if not any(self.fragments(s, edges) for s, edges in strings):
            return None
        free = (c for c in _CANDIDATES if not any(c in s for s, _ in strings))
        open_, close = next(free, None), next(free, None)
        if open_ is None or close is None:
            raise ValueError("the messages use every character a control-token check could mark text with")
        table: list[str] = []

        def mark(text: str, edges: bool) -> str:
            spans = self.fragments(text, edges)
            if not spans:
                return text
            out, at = [], 0
            for a, b in spans:
                out.append(text[at:a])
                out.append(f"{open_}{len(table)}{close}")
                table.append(text[a:b])
                at = b
            out.append(text[at:])
            return "".join(out)

        def walk(value: Any, key: Any = None) -> Any:
            if isinstance(value, str):
                return mark(value, edges=key not in _NOT_TEXT_KEYS)
            if isinstance(value, Mapping):
                return {mark(k, False) if isinstance(k, str) else k: walk(v, k) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(walk(v) for v in value)
            return value

        sentinel = re.compile(f"{re.escape(open_)}(\\d+){re.escape(close)}")

        def fragment(match: re.Match[str]) -> str:
            index = int(match.group(1))
            return table[index] if index < len(table) else match.group(0)

        return Protected(walk(messages), walk(tools), lambda text: sentinel.sub(fragment, text))


def _strings(value: Any) -> Iterable[tuple[str, bool]]:
    """Every string of a chat and whether all rules check it (False: a key, or a `role` or `type`
    value: full tokens only). Iterative: tool parameters nest deep."""
    stack: list[tuple[Any, Any]] = [(value, None)]
    while stack:
        item, key = stack.pop()
        if isinstance(item, str):
            yield item, key not in _NOT_TEXT_KEYS
        elif isinstance(item, Mapping):
            for k, v in item.items():
                if isinstance(k, str):
                    yield k, False
                stack.append((v, k))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, None) for v in item)
