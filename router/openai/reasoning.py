"""Reasoning models' answers in /v1/chat/completions: the `<think>...</think>` part as
`reasoning_content`, the rest as `content` (DeepSeek's API field, as vLLM's deepseek_r1 parser).

Contract
- input: a model's tokenizer (`reasoning_of`: the mode of a model whose vocabulary has `<think>` and
  `</think>` as single tokens, e.g. DeepSeek-R1 and its Llama / Qwen distills, QwQ; None for the
  others, whose answers are left whole); a choice's generated text, whole or in pieces.
- output: `reasoning_modes(model_table)` -> {id: mode} of the served reasoning models (logged;
  tags that are special tokens make none: the streamed text leaves them out);
  `split(text, mode) -> (reasoning, content)`: with `mode.opened` (the chat template ends its
  prompt with `<think>`, as R1's does) the text up to `</think>` is reasoning; otherwise only a
  text that starts with `<think>` has any. A leading `<think>` is not part of the reasoning.
  Without `</think>` (cut by max_tokens) all of it is reasoning. The content after `</think>`
  starts at its first non-whitespace character; an empty part is None.
  `ReasoningStream.feed(text) -> [delta]`, `.finish() -> [delta]`: deltas (`{"reasoning_content"}`
  / `{"content"}`) whose concatenation equals `split` of the whole text; only a possible tag's
  start and the whitespace a split would drop are held back.
- state: `ReasoningStream` holds at most a tag's length of text (and leading whitespace).
- failure modes: none (any text splits).
- proven by: tests/test_tool_answers.py (a table, and every cut of each text through the stream).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    opened: bool  # the template opens the think block itself: the answer starts inside it
    open_id: int = -1  # the <think> and </think> token ids (a grammar names them: after_thinking)
    close_id: int = -1


def reasoning_of(tokenizer) -> Reasoning | None:
    """The reasoning mode of a model (a `common.tokenizer.Tokenizer`), None when it has none."""
    ids = tokenizer.encode(OPEN + CLOSE)
    if len(ids) != 2:
        return None
    if any(tokenizer.is_special(i) for i in ids):  # the text streamed to clients leaves them out
        log.warning("<think> and </think> are special tokens of this vocabulary: answers stay whole")
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    except Exception:  # noqa: BLE001 - a template that refuses this probe: assume it does not open one
        prompt = ""
    return Reasoning(opened=prompt.rstrip().endswith(OPEN), open_id=ids[0], close_id=ids[1])


def reasoning_modes(models) -> dict[str, Reasoning]:
    """The reasoning models of a `router.models.ModelTable` (id -> mode), each logged."""
    modes = {}
    for name in models.ids():
        mode = reasoning_of(models.tokenizer(name))
        if mode is not None:
            log.info(
                "model %s reasons in <think> blocks (opened by its template: %s): chat answers "
                "split into reasoning_content and content",
                name,
                mode.opened,
            )
            modes[name] = mode
    return modes


def split(text: str, mode: Reasoning) -> tuple[str | None, str | None]:
    body = text
    if text.lstrip().startswith(OPEN):  # (opened: the model may write the tag again)
        body = text.lstrip()[len(OPEN) :]
    elif not mode.opened:
        return None, text or None
    end = body.find(CLOSE)
    if end < 0:
        return body or None, None
    return body[:end] or None, body[end + len(CLOSE) :].lstrip() or None


def _tag_start(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningStream:
    def __init__(self, mode: Reasoning):
        self._opened = mode.opened
        self._state = "start"  # start | reasoning | after | content
        self._held = ""

    def feed(self, text: str) -> list[dict]:
        self._held += text
        out: list[dict] = []
        while True:
            held = self._held
            if self._state == "start":
                head = held.lstrip()
                if not head or (len(head) < len(OPEN) and OPEN.startswith(head)):
                    return out  # whitespace, or maybe the tag: wait
                if head.startswith(OPEN):
                    self._held, self._state = head[len(OPEN) :], "reasoning"
                    continue
                self._state = "reasoning" if self._opened else "content"  # no tag: as the mode says
            if self._state == "reasoning":
                end = held.find(CLOSE)
                if end >= 0:
                    if end:
                        out.append({"reasoning_content": held[:end]})
                    self._held, self._state = held[end + len(CLOSE) :], "after"
                    continue
                keep = _tag_start(held, CLOSE)
                if len(held) > keep:
                    out.append({"reasoning_content": held[: len(held) - keep]})
                self._held = held[len(held) - keep :]
                return out
            if self._state == "after":
                if not held.strip():
                    self._held = ""  # the whitespace after </think> is not content
                    return out
                held, self._state = held.lstrip(), "content"
            if held:
                out.append({"content": held})
            self._held = ""
            return out

    def finish(self) -> list[dict]:
        held, self._held = self._held, ""
        if not held or self._state == "after":
            return []
        reasoning = self._state == "reasoning" or (self._state == "start" and self._opened)
        return [{"reasoning_content" if reasoning else "content": held}]
